"""OpenAI request bodies -> validated generation requests; errors in OpenAI's error shape.

Every check names the parameter and what would be valid, so a client can fix its request. Numbers
must be JSON numbers (a bool is not a number here), and unsupported options that would change the
answer (echo, penalties, ...) are refused rather than silently ignored; unknown fields are
ignored, as most OpenAI-compatible servers do. Logprobs and response_format: request_options.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ftexpert.coordinator.harmony import call_grammar as harmony_call_grammar, final_message_grammar
from ftexpert.coordinator.request_options import parse_logprobs, parse_response_format
from ftexpert.coordinator.text_codec import CHATML_ROLES, ChatMessage, TextCodec, TooManyTokens
from ftexpert.coordinator.token_bounds import utf8_length_over
from ftexpert.coordinator.tool_calls import (Tool, ToolChoice, ToolError, call_grammar, callable_tools,
                                             parse_openai_tools)
from ftexpert.proto.grammar_spec import GrammarError, GrammarSpec, check_grammar
from ftexpert.proto.sampling_params import BadSamplingParam, PromptTooLong, SamplingParams, check_prompt

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_PROMPTS = 64
MAX_MESSAGES = 4096
COMPLETION_DEFAULT_MAX_TOKENS = 16        # as OpenAI's /v1/completions
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s      # a 503 the client may retry: its Retry-After header

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int          # prompt + generated tokens the engine can hold for one request
    codec: TextCodec
    created: int = 0
    owned_by: str = "ft-expert-service"


@dataclass
class GenerationPlan:
    """One API request: one or more prompts, each sampled n times."""
    prompts: list[list[int]]
    n: int
    sampling: list[SamplingParams]   # per choice (prompt-major, then n), seeds differ per choice
    stop: list[str]
    stream: bool
    include_usage: bool
    tools: list[Tool] = field(default_factory=list)          # chat: the tools offered, and the choice
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    harmony: bool = False            # chat with a harmony template: the text keeps special tokens, harmony.py parses it

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def check_unicode(body: Any) -> None:
    """Every string in the body must be valid Unicode: JSON's \\uXXXX escapes can spell a lone UTF-16
    surrogate, which no tokenizer or UTF-8 encoder takes."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if value.isascii():
                continue
            try:
                value.encode("utf-8")       # C speed; a regex scan of 8 MB would hold the GIL for 50 ms
            except UnicodeEncodeError as exc:
                name = where or "the request body"
                raise bad(f"'{name}' holds a lone UTF-16 surrogate (\\u{ord(value[exc.start]):04x}) at character "
                          f"{exc.start}; that is not valid Unicode: send the whole surrogate pair (as in "
                          f"\\ud83d\\ude00) or the character itself", where or None, "invalid_unicode") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, where or "the request body's keys"))
                stack.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


def _check_prompt_bytes(text_bytes_over: Any, model: ModelInfo, param: str) -> None:
    """Refuse, before tokenizing, a prompt too long in bytes to fit the context in tokens (token_bounds.py)."""
    limit = model.codec.max_prompt_bytes(model.context_length)
    if limit is not None and text_bytes_over(limit):
        raise bad(f"This model's maximum context length is {model.context_length} tokens, and the prompt has more "
                  f"than {limit} bytes, more than that many tokens can hold with this tokenizer; shorten the "
                  f"prompt", param, "context_length_exceeded")


def _too_many(exc: TooManyTokens, model: ModelInfo, param: str) -> ApiError:
    return bad(f"This model's maximum context length is {model.context_length} tokens, but the prompt has at least "
               f"{exc.at_least} tokens; shorten the prompt", param, "context_length_exceeded")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _get_number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    return float(v)


def _get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _check_model(body: dict, model: ModelInfo) -> None:
    name = body.get("model")
    if name is None:
        raise bad("you must provide a 'model' parameter; GET /v1/models lists the served model", "model")
    if not isinstance(name, str):
        raise bad(f"'model' must be a string, got {name!r}", "model")
    if name != model.name:
        raise ApiError(404, f"The model '{name[:200]}' does not exist; this server serves '{model.name}'",
                       param="model", code="model_not_found")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    def refuse(name: str, what: str) -> None:
        option = f"'{name}' {what}" if what else f"'{name}'"
        raise bad(f"{option} is not supported by this server; remove it", name, "unsupported_parameter")

    if not chat:
        if body.get("echo") not in (None, False):
            refuse("echo", "(true)")
        if body.get("best_of") not in (None, 1):
            refuse("best_of", "(above 1)")
        if body.get("suffix") not in (None, ""):
            refuse("suffix", "")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            refuse(name, "(non-zero)")
    if body.get("logit_bias") not in (None, {}):
        refuse("logit_bias", "")


def _parse_stop(body: dict, name: str = "stop") -> list[str]:
    stop = body.get(name)
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad(f"'{name}' must be a string or a list of strings", name)
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'{name}' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", name)
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad(f"each stop string must have at most {MAX_STOP_STRING_CHARS} characters", name)
    return [s for s in stop if s]


def _parse_common(body: dict, model: ModelInfo, prompts: list[list[int]], max_tokens: int | None,
                  max_tokens_param: str, chat: bool) -> GenerationPlan:
    try:
        for prompt in sorted(prompts, key=len, reverse=True):     # the longest sets the default max_tokens
            max_tokens = check_prompt(prompt, max_tokens, model.context_length, model.codec.vocab_size,
                                      max_tokens_param)
    except PromptTooLong as exc:
        raise bad(str(exc), exc.param, "context_length_exceeded") from None
    except ValueError as exc:
        raise bad(str(exc), "prompt") from None
    temperature = _get_number(body, "temperature", 1.0)
    top_p = _get_number(body, "top_p", 1.0)
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:          # -1 (vLLM's "off") and 0 both mean off
        top_k = 0
    elif not _is_int(top_k):
        raise bad(f"'top_k' must be an integer, -1 or 0 (off) or >= 1, got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
        raise bad(f"'seed' must be an integer in [-2^63, 2^64), got {seed!r}", "seed")
    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad(f"'n' must be an integer from 1 to {MAX_N}, got {n!r}", "n")
    stream = _get_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = _get_bool(options, "include_usage")
    ignore_eos = _get_bool(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids") or []
    vocab = model.codec.vocab_size
    if not isinstance(stop_ids, list) or not all(_is_int(i) and 0 <= i < vocab for i in stop_ids):
        raise bad(f"'stop_token_ids' must be a list of token ids in [0, {vocab})", "stop_token_ids")
    if len(stop_ids) > MAX_STOP_STRINGS:
        raise bad(f"'stop_token_ids' may hold at most {MAX_STOP_STRINGS} ids", "stop_token_ids")
    stop_token_ids = tuple(stop_ids) + (() if ignore_eos else tuple(model.codec.eos_token_ids))
    stop = _parse_stop(body)
    logprobs = parse_logprobs(body, chat, bad)
    grammar = parse_response_format(body, bad)
    try:
        sampling = [SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=None if seed is None else (seed + j) % (1 << 63), ignore_eos=ignore_eos,
                                   stop_token_ids=stop_token_ids, logprobs=logprobs, grammar=grammar)
                    for _prompt in prompts for j in range(n)]
    except BadSamplingParam as exc:
        param = max_tokens_param if exc.field == "max_new_tokens" else exc.field
        raise bad(f"'{param}' {exc.problem}", param) from None
    return GenerationPlan(prompts, n, sampling, stop, stream, include_usage)


def _parse_max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> tuple[int | None, str]:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise bad(f"'{name}' must be an integer >= 1, got {v!r}", name)
        return v, name
    return default, names[0]


def parse_completion(body: Any, model: ModelInfo) -> GenerationPlan:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_unicode(body)
    _check_model(body, model)
    _refuse_unsupported(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                  "lists", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    ids: list[list[int]] = []
    for p in prompts:
        if isinstance(p, str):
            _check_prompt_bytes(lambda limit: utf8_length_over(p, limit), model, "prompt")
            try:
                ids.append(model.codec.encode(p, limit=model.context_length))
            except TooManyTokens as exc:
                raise _too_many(exc, model, "prompt") from None
        elif all(_is_int(t) for t in p):
            ids.append(list(p))
        else:
            raise bad(f"token ids in 'prompt' must be integers in [0, {model.codec.vocab_size})", "prompt")
    max_tokens, param = _parse_max_tokens(body, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    return _parse_common(body, model, ids, max_tokens, param, chat=False)


def parse_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(raw) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in CHATML_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHATML_ROLES)}, got {role!r}", f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        calls = _parse_tool_calls(m.get("tool_calls"), role, where)
        call_id = m.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise bad(f"{where}.tool_call_id must be the id of the call this tool message answers",
                      f"{where}.tool_call_id")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}; images "
                              f"and audio are not supported", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        name = m.get("name")
        out.append(ChatMessage(role, content, calls, call_id if role == "tool" else None,
                               name if role == "tool" and isinstance(name, str) else None))
    return out


def _parse_tool_calls(raw: Any, role: str, where: str) -> list[dict] | None:
    """An assistant message's `tool_calls` (the calls it made, sent back in the history)."""
    if raw is None or raw == []:
        return None
    if role != "assistant":
        raise bad(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments"), str) or not isinstance(call.get("id"), str):
            raise bad(f"{at} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                      f"\"arguments\": \"<JSON text>\"}}}}", at)
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return calls


def parse_chat(body: Any, model: ModelInfo) -> GenerationPlan:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_unicode(body)
    _check_model(body, model)
    _refuse_unsupported(body, chat=True)
    messages = parse_messages(body.get("messages"))
    try:
        tools, choice = parse_openai_tools(body)
    except ToolError as exc:
        raise bad(str(exc), exc.param) from None
    if choice.mode in ("required", "function") and body.get("response_format") not in (None, {"type": "text"}):
        raise bad("'response_format' and a 'tool_choice' that forces a call both constrain the reply; send one",
                  "response_format")
    forced = forced_call(tools, choice, model)
    prompt_ids = encode_chat_prompt(messages, model, rendered_tools(tools, choice, model))
    max_tokens, param = _parse_max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    return with_tools(_parse_common(body, model, [prompt_ids], max_tokens, param, chat=True), tools, choice, forced,
                      model)


def with_tools(plan: GenerationPlan, tools: list[Tool], choice: ToolChoice, forced: GrammarSpec | None,
               model: ModelInfo) -> GenerationPlan:
    """A chat plan with its tools, the reply's format, and the forced call's grammar on every choice (a harmony
    model's `response_format` grammar put in its final channel: harmony.final_message_grammar)."""
    plan.tools, plan.tool_choice, plan.harmony = tools, choice, model.codec.chat_template.harmony
    if forced is not None:
        plan.sampling = [dataclasses.replace(p, grammar=forced) for p in plan.sampling]
    elif plan.harmony:
        plan.sampling = [p if p.grammar is None else dataclasses.replace(p, grammar=final_message_grammar(p.grammar))
                         for p in plan.sampling]
    return plan


def rendered_tools(tools: list[Tool], choice: ToolChoice, model: ModelInfo) -> list[dict] | None:
    """The tools the chat template is given (OpenAI's form; none when the choice is none), or a 400 where the
    model's template cannot take them."""
    if not tools or choice.mode == "none":
        return None
    try:
        model.codec.chat_template.check_tools()
    except ValueError as exc:
        raise bad(str(exc), "tools", "unsupported_parameter") from None
    return [t.openai() for t in tools]


def forced_call(tools: list[Tool], choice: ToolChoice, model: ModelInfo) -> GrammarSpec | None:
    """A choice that requires a call ("required" / any, or a named function): the grammar of one call in the
    model's format (tool_calls.call_grammar, or harmony.call_grammar); otherwise None."""
    if choice.mode not in ("required", "function"):
        return None
    grammar_of = harmony_call_grammar if model.codec.chat_template.harmony else call_grammar
    grammar = GrammarSpec("grammar", grammar_of(callable_tools(tools, choice)))
    try:
        check_grammar(grammar)
    except GrammarError as exc:
        raise bad(f"a tool's schema ('parameters', or Anthropic's 'input_schema') does not compile: {exc}", "tools",
                  "invalid_json_schema") from None
    except ImportError:
        raise bad("a 'tool_choice' that forces a call needs the grammar engine (llguidance), which this server "
                  "lacks; send \"auto\" or install llguidance", "tool_choice", "unsupported_parameter") from None
    return grammar


def encode_chat_prompt(messages: list[ChatMessage], model: ModelInfo, tools: list[dict] | None = None) -> list[int]:
    """The messages (and `tools`, OpenAI's form) through the model's chat template, tokenized; 400 naming 'messages'
    when they cannot fit."""
    # the template only adds tokens: the messages' text alone must fit
    _check_prompt_bytes(lambda limit: utf8_length_over("".join(m.content for m in messages), limit), model,
                        "messages")
    try:
        return model.codec.encode_chat(messages, limit=model.context_length, tools=tools)
    except TooManyTokens as exc:
        raise _too_many(exc, model, "messages") from None
    except ValueError as exc:
        raise bad(str(exc), "messages") from None
