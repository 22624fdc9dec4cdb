"""Anthropic Messages request bodies -> validated generation requests; errors in Anthropic's error shape.

POST /v1/messages and /v1/messages/count_tokens take Anthropic's body: a `system` prompt (a string or text blocks)
and `messages`, user and assistant turns whose content is a string or a list of content blocks. The conversation
goes through the model's chat template exactly as /v1/chat/completions' messages do (`encode_chat_prompt`; the
text blocks of one turn are joined as chat completions joins text parts), and the sampling fields through the
checks the OpenAI routes use (`_parse_common`: check_prompt, SamplingParams, stop strings, the model's EOS).

As on the OpenAI routes, every check names the field and what would be valid, unknown fields are ignored, and
what this server cannot honour and would change the answer is refused, not ignored: server tools, extended
thinking, structured output, image and document blocks, and a last assistant turn to continue (prefill).

Tools (`tools`, `tool_choice`) are read by coordinator/tool_calls.py (parse_anthropic_tools) and rendered by the
chat template as the OpenAI route's are; tool_use blocks of the history become the assistant's calls, tool_result
blocks `tool` messages. Content blocks are read one function per block type and role (BLOCK_PARSERS), each adding
what its block says to the turn (_Turn) it belongs to.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from ftexpert.coordinator.openai_requests import (MAX_MESSAGES, ApiError, GenerationPlan, ModelInfo, _check_model,
                                                  _parse_common, _parse_max_tokens, _parse_stop, bad, check_unicode,
                                                  encode_chat_prompt, forced_call, rendered_tools,
                                                  with_tools)
from ftexpert.coordinator.text_codec import ChatMessage
from ftexpert.coordinator.tool_calls import Tool, ToolChoice, ToolError, parse_anthropic_tools

MESSAGES_PATH = "/v1/messages"
MESSAGE_ROLES = ("user", "assistant")
MAX_USER_ID_CHARS = 256

# Anthropic's error types by HTTP status; a 503 the client may retry is `overloaded_error`, other 5xx `api_error`
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 504: "timeout_error"}


def is_anthropic_path(path: str) -> bool:
    """The routes whose errors are in Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    if err.status == 503 and err.retry_after_s is not None:
        kind = "overloaded_error"
    else:
        kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _json_kind(value: Any) -> str:
    """What a JSON value is, for messages (not the value: it may be long)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in ((str, "a string"), ((int, float), "a number"), (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


# ---------------------------------------------------------------- content blocks

@dataclass
class _Turn:
    """What one turn's content blocks put into the conversation: text; an assistant turn's tool calls (tool_use
    blocks, in OpenAI's call form, which chat templates read); a user turn's tool results (tool_result blocks),
    rendered as `tool` messages before the turn's text. `call_ids`: the tool_use ids of the conversation so far
    and the tools they called (shared by every turn); a tool_result must answer one."""
    role: str
    call_ids: dict[str, str] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    results: list[ChatMessage] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not any(self.texts) and not self.calls and not self.results

    def messages(self) -> list[ChatMessage]:
        text = "".join(self.texts)
        if self.role == "assistant":
            return [ChatMessage("assistant", text, self.calls or None)]
        return self.results + ([ChatMessage(self.role, text)] if text or not self.results else [])


BlockParser = Callable[[dict, str, _Turn], None]


def _text_block(block: dict, where: str, turn: _Turn) -> None:
    """{"type": "text", "text": ...}; `cache_control` and `citations` do not change the answer and are ignored."""
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"'{where}.text' must be a string, got {_json_kind(text)}", f"{where}.text")
    turn.texts.append(text)


def _tool_use_block(block: dict, where: str, turn: _Turn) -> None:
    """{"type": "tool_use", "id", "name", "input": {...}}: a call the assistant made, sent back in the history."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"'{where}.id' must be the call's id (a non-empty string), got {_json_kind(call_id)}", f"{where}.id")
    if call_id in turn.call_ids:
        raise bad(f"'{where}.id' {call_id[:100]!r} is the id of an earlier tool_use block; each call's id is unique",
                  f"{where}.id")
    if not isinstance(name, str) or not name:
        raise bad(f"'{where}.name' must be the called tool's name, got {_json_kind(name)}", f"{where}.name")
    if not isinstance(args, dict):
        raise bad(f"'{where}.input' must be the call's input object, got {_json_kind(args)}", f"{where}.input")
    turn.call_ids[call_id] = name
    turn.calls.append({"id": call_id, "type": "function",
                       "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})


RESULT_ERROR_PREFIX = "Error: "      # a tool_result with is_error true reaches the model with this before its text


def _tool_result_block(block: dict, where: str, turn: _Turn) -> None:
    """{"type": "tool_result", "tool_use_id", "content"?: a string or text blocks, "is_error"?}: the result of a
    call of the previous assistant turn. The blocks come before any text of their turn, as Anthropic requires."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in turn.call_ids:
        raise bad(f"'{where}.tool_use_id' must be the id of a tool_use block of an earlier assistant turn, got "
                  f"{str(call_id)[:100]!r}", f"{where}.tool_use_id")
    if any(turn.texts):
        raise bad(f"'{where}' follows text in its turn: tool_result blocks come first in a user turn, then any text",
                  where)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"'{where}.is_error' must be true or false, got {_json_kind(is_error)}", f"{where}.is_error")
    result = _Turn("tool")
    content = block.get("content")
    if content is not None:
        _parse_content(content, f"{where}.content", result, RESULT_BLOCK_PARSERS)
    text = "".join(result.texts)
    turn.results.append(ChatMessage("tool", (RESULT_ERROR_PREFIX + text) if is_error else text, None, call_id,
                                    turn.call_ids[call_id]))


SYSTEM_BLOCK_PARSERS: dict[str, BlockParser] = {"text": _text_block}
RESULT_BLOCK_PARSERS: dict[str, BlockParser] = {"text": _text_block}
BLOCK_PARSERS: dict[str, dict[str, BlockParser]] = {
    "user": {"text": _text_block, "tool_result": _tool_result_block},
    "assistant": {"text": _text_block, "tool_use": _tool_use_block},
}

# block types Anthropic defines that this server refuses, and why
UNSUPPORTED_BLOCKS = {
    "image": "images are not supported: the served model reads text only",
    "document": "documents are not supported: send the document's text as a text block",
    "search_result": "search result blocks are not supported: send their text as a text block",
    "tool_use": "only an assistant turn holds tool_use blocks",
    "tool_result": "only a user turn holds tool_result blocks",
    "server_tool_use": "server tools are not supported by this server",
    "thinking": "extended thinking is not supported by this server",
    "redacted_thinking": "extended thinking is not supported by this server",
}


def _parse_content(content: Any, where: str, turn: _Turn, parsers: dict[str, BlockParser]) -> None:
    valid = " or ".join(repr(t) for t in parsers)
    if isinstance(content, str):
        turn.texts.append(content)
        return
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of content blocks (type {valid}), got "
                  f"{_json_kind(content)}", where)
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(block, dict):
            raise bad(f"'{at}' must be a content block object, such as {{\"type\": \"text\", \"text\": \"...\"}}; "
                      f"got {_json_kind(block)}", at)
        kind = block.get("type")
        parser = parsers.get(kind) if isinstance(kind, str) else None
        if parser is None:
            why = UNSUPPORTED_BLOCKS.get(kind) if isinstance(kind, str) else None
            if why:
                what = f"has type {kind!r}: {why}"
            else:
                what = "has no 'type'" if kind is None else f"has the unknown type {str(kind)[:100]!r}"
            raise bad(f"'{at}' {what}; the content block types accepted here: {valid}", f"{at}.type",
                      "unsupported_content_block" if why else None)
        parser(block, at, turn)


def _conversation(body: dict) -> list[ChatMessage]:
    """`system` and `messages` as the chat template's messages."""
    out: list[ChatMessage] = []
    call_ids: dict[str, str] = {}
    system = body.get("system")
    if system is not None:
        turn = _Turn("system")
        _parse_content(system, "system", turn, SYSTEM_BLOCK_PARSERS)
        if not turn.empty:
            out += turn.messages()
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list of {\"role\": \"user\" | \"assistant\", \"content\": ...} "
                  f"objects, got {_json_kind(raw)}{' (empty)' if raw == [] else ''}", "messages")
    if len(raw) > MAX_MESSAGES:
        raise bad(f"'messages' has {len(raw)} messages; at most {MAX_MESSAGES} are allowed", "messages")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content', got {_json_kind(message)}", where)
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            hint = "; a system prompt goes in the top-level 'system' field" if role == "system" else ""
            raise bad(f"'{where}.role' must be 'user' or 'assistant', got {str(role)[:100]!r}{hint}", f"{where}.role")
        turn = _Turn(role, call_ids)
        _parse_content(message.get("content"), f"{where}.content", turn, BLOCK_PARSERS[role])
        if turn.empty:
            raise bad(f"'{where}.content' is empty; every message needs some non-empty text, a tool_use or a "
                      f"tool_result block", f"{where}.content")
        out += turn.messages()
    if raw[-1]["role"] == "assistant":
        last = f"messages[{len(raw) - 1}].role"
        raise bad(f"'{last}' is 'assistant': continuing a partial assistant turn (prefill) is not supported by this "
                  f"server; end 'messages' with a user turn", last, "unsupported_parameter")
    return out


# ---------------------------------------------------------------- top-level fields

def _refuse_unsupported(body: dict) -> None:
    def refuse(name: str, what: str) -> None:
        raise bad(f"'{name}' ({what}) is not supported by this server; remove it", name, "unsupported_parameter")

    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        refuse("thinking", "extended thinking; {\"type\": \"disabled\"} is accepted")
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad(f"'output_config' must be an object, got {_json_kind(config)}", "output_config")
    for key, what in (("format", "structured output"), ("effort", "reasoning effort")):
        if (config or {}).get(key) is not None:
            refuse(f"output_config.{key}", what)
    for name, what in (("mcp_servers", "MCP servers"), ("container", "code execution containers"),
                       ("context_management", "context management")):
        if body.get(name) not in (None, [], {}):
            refuse(name, what)


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad(f"'metadata' must be an object such as {{\"user_id\": \"...\"}}, got {_json_kind(metadata)}",
                  "metadata")
    for key in metadata:
        if key != "user_id":
            raise bad(f"'metadata.{str(key)[:100]}' is not a metadata field: 'metadata' takes only 'user_id'",
                      f"metadata.{key}")
    user_id = metadata.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > MAX_USER_ID_CHARS):
        raise bad(f"'metadata.user_id' must be a string of at most {MAX_USER_ID_CHARS} characters or null",
                  "metadata.user_id")


def _checked(body: Any, model: ModelInfo) -> dict:
    """What /v1/messages and count_tokens check alike, before the conversation."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_json_kind(body)}")
    check_unicode(body)
    _check_model(body, model)
    _refuse_unsupported(body)
    return body


def parse_messages_request(body: Any, model: ModelInfo) -> GenerationPlan:
    """A POST /v1/messages body -> one prompt, sampled once."""
    body = _checked(body, model)
    _check_metadata(body.get("metadata"))
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required: the most tokens to generate, an integer >= 1 (with the prompt, within "
                  f"the model's context of {model.context_length} tokens)", "max_tokens")
    max_tokens, param = _parse_max_tokens(body, ("max_tokens",), None)
    # the fields the OpenAI routes share, under their names there (top_k: Anthropic's, also an OpenAI extension)
    fields = {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
              "stream": body.get("stream"), "stop": _parse_stop(body, "stop_sequences")}
    tools, choice = _tools(body)
    forced = forced_call(tools, choice, model)
    plan = _parse_common(fields, model, [_prompt(body, model, tools, choice)], max_tokens, param, chat=True)
    return with_tools(plan, tools, choice, forced, model)


def _tools(body: dict) -> tuple[list[Tool], ToolChoice]:
    try:
        return parse_anthropic_tools(body)
    except ToolError as exc:
        raise bad(str(exc), exc.param) from None


def _prompt(body: dict, model: ModelInfo, tools: list[Tool], choice: ToolChoice) -> list[int]:
    """The conversation and the tools through the model's chat template, tokenized."""
    return encode_chat_prompt(_conversation(body), model, rendered_tools(tools, choice, model))


def parse_count_tokens(body: Any, model: ModelInfo) -> int:
    """A POST /v1/messages/count_tokens body -> the prompt's tokens, rendered as /v1/messages renders it (with
    its tools)."""
    body = _checked(body, model)
    return len(_prompt(body, model, *_tools(body)))
