"""Text in and out of the engine: the model's tokenizer, its chat template, its end-of-sequence ids.

Loaded from a model directory in the Hugging Face layout: tokenizer.json (a `tokenizers.Tokenizer`),
tokenizer_config.json (chat_template, bos/eos tokens), optionally generation_config.json (eos ids).
The chat template is rendered with jinja2 in a sandbox, as transformers does; a model without a
template (or a machine without jinja2) gets a built-in ChatML format, and says so in a log line.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Sequence

from ftexpert.coordinator.token_bounds import max_bytes_per_token

log = logging.getLogger("ft.coordinator.text")

CHATML_ROLES = ("system", "user", "assistant", "tool", "developer")
PLACEHOLDER_OPEN, PLACEHOLDER_CLOSE = "\ue000", "\ue001"    # private-use characters around a nonce


COUNT_IN_PIECES_ABOVE_CHARS = 1 << 18    # a longer text is first counted piece by piece against the limit
PIECE_CHARS = 1 << 16
PIECE_SLACK_TOKENS = 4                   # most tokens a cut can add (a normalizer's Prepend, a split merge)
_PIECE_CUT = re.compile(r" (?=\S)")     # before a space that starts a word: a pre-tokenizer boundary


class TooManyTokens(ValueError):
    """The text has more than `limit` tokens (at least `at_least`); it was not tokenized whole."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text has at least {at_least} tokens, over {limit}")
        self.at_least, self.limit = at_least, limit


def _batch_encode(tokenizer: Any) -> Any:
    # encode_batch* run without the GIL (encode holds it throughout); the _fast variant skips offsets
    return getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch


def _encode(tokenizer: Any, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int]:
    if limit is not None and len(text) > COUNT_IN_PIECES_ABOVE_CHARS:
        _count_up_to(tokenizer, text, limit)
    return list(_batch_encode(tokenizer)([text], add_special_tokens=add_special_tokens)[0].ids)


def _count_up_to(tokenizer: Any, text: str, limit: int) -> None:
    """Raise TooManyTokens as soon as pieces of `text` surely hold more than `limit` tokens.

    Pieces are cut before a space that starts a word, where byte-level and SentencePiece pre-tokenizers cut
    anyway; PIECE_SLACK_TOKENS per cut covers what a cut can add. Tokenizing stops at the first pieces over the
    limit, so an over-long prompt costs about a context's worth of tokenizing, and no Encoding (whose creation
    and release hold the GIL) is larger than a piece's."""
    encode = _batch_encode(tokenizer)
    total = cuts = start = 0
    while start < len(text):
        m = _PIECE_CUT.search(text, start + PIECE_CHARS)
        end = m.start() if m is not None else len(text)
        total += len(encode([text[start:end]], add_special_tokens=False)[0])
        if m is not None:
            cuts += 1
        start = end
        if total - PIECE_SLACK_TOKENS * cuts > limit:
            raise TooManyTokens(total - PIECE_SLACK_TOKENS * cuts, limit)


@dataclass
class ChatMessage:
    role: str
    content: str
    tool_calls: list[dict] | None = None    # an assistant turn's calls, OpenAI's form: {id, type, function}
    tool_call_id: str | None = None         # a tool turn: the call it answers
    name: str | None = None                 # a tool turn: the function's name

    def template_dict(self) -> dict:
        """The message as chat templates read it (transformers' form)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [_with_object_arguments(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _with_object_arguments(call: dict) -> dict:
    """A call as templates read it (transformers' form): `function.arguments` an object, not OpenAI's JSON text,
    where the text is one (gpt-oss's template writes `arguments | tojson`; Qwen's take either)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


TOOLS_PREAMBLE = ("# Tools\n\nFunctions you may call are listed as JSON signatures inside <tools></tools>:\n"
                  "<tools>")
TOOLS_INSTRUCTION = ("\n</tools>\n\nTo call one, reply with a JSON object holding its name and arguments inside "
                     "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                     "<args-json-object>}\n</tool_call>")


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(fn.get("name"), ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def render_chatml(messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                  tools: Sequence[dict] | None = None) -> str:
    """ChatML; with `tools`, the tool signatures in the system turn and calls / results in the Hermes form that
    coordinator/tool_calls.py parses."""
    out = []
    rest = list(messages)
    if tools:
        system = rest.pop(0).content + "\n\n" if rest and rest[0].role == "system" else ""
        sigs = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        out.append(f"<|im_start|>system\n{system}{TOOLS_PREAMBLE}{sigs}{TOOLS_INSTRUCTION}<|im_end|>\n")
    for m in rest:
        if m.role == "tool":
            out.append(f"<|im_start|>user\n<tool_response>\n{m.content}\n</tool_response><|im_end|>\n")
            continue
        calls = "\n".join(_call_text(c) for c in m.tool_calls or ())
        sep = "\n" if calls and m.content else ""
        out.append(f"<|im_start|>{m.role}\n{m.content}{sep}{calls}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class ChatTemplate:
    """A Hugging Face chat template (jinja2), or ChatML when `source` is None."""

    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        self.special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._compiled = None
        if source is not None:
            try:
                self._compiled = self._compile(source)
            except ImportError:
                log.warning("jinja2 is not installed: using the built-in ChatML format instead of the "
                            "model's chat template; `pip install jinja2` to use the model's own")

    @staticmethod
    def _compile(source: str):
        # lazy: an optional library, loaded where a model's files need it
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ValueError(f"chat template refused the messages: {message}")

        def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"],
                                            undefined=jinja2.Undefined)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}; fix "
                             f"tokenizer_config.json's chat_template") from None

    @property
    def kind(self) -> str:
        return "jinja2" if self._compiled is not None else "chatml"

    @property
    def harmony(self) -> bool:
        """The template writes gpt-oss's harmony format (channels): replies are parsed by coordinator/harmony.py."""
        return self.source is not None and self._compiled is not None and "<|channel|>" in self.source

    def check_tools(self) -> None:
        """Raise ValueError where this template cannot be given tools: it never reads them."""
        if self.source is None or self._compiled is None:
            return
        if "tools" not in self.source:
            raise ValueError("this model's chat template does not render tools; send the request without 'tools' "
                             "or serve the model with a chat template that renders them")

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
        """The prompt text; `tools` (OpenAI's form) only where given (check_tools says whether they can be)."""
        if self._compiled is None:
            return render_chatml(messages, add_generation_prompt, tools)
        # lazy: an optional library, loaded where a model's files need it
        import jinja2
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self._compiled.render(messages=[m.template_dict() for m in messages],
                                         add_generation_prompt=add_generation_prompt, **extra, **self.special)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed on these messages: {exc}") from None


@dataclass
class TextCodec:
    tokenizer: Any                          # tokenizers.Tokenizer
    chat_template: ChatTemplate
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_model_dir(cls, model_dir: str, eos_token_ids: Sequence[int] | None = None) -> "TextCodec":
        """The tokenizer files of `model_dir`. eos_token_ids: the model's end-of-sequence ids where the caller knows
        them (`ft serve`: ModelFacts, which adds config.json's); None: generation_config.json's and the eos token's."""
        # lazy: an optional library, loaded where a model's files need it
        from tokenizers import Tokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: a model directory needs the tokenizer.json of its "
                                    f"model (Hugging Face layout)")
        tokenizer = Tokenizer.from_file(path)
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        template = config.get("chat_template")
        jinja = os.path.join(model_dir, "chat_template.jinja")   # newer checkpoints (gpt-oss's harmony format)
        if not template and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if not isinstance(template, str):
            log.info("%s has no chat template: chat requests use ChatML", model_dir)
            template = None
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if eos_token_ids is not None:
            return cls(tokenizer, ChatTemplate(template, bos, eos), sorted(set(eos_token_ids)))
        eos_ids: list[int] = []
        gen = _read_json(os.path.join(model_dir, "generation_config.json"))
        raw = gen.get("eos_token_id")
        if isinstance(raw, int):
            eos_ids.append(raw)
        elif isinstance(raw, list):
            eos_ids.extend(i for i in raw if isinstance(i, int))
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            eos_ids.append(tokenizer.token_to_id(eos))
        return cls(tokenizer, ChatTemplate(template, bos, eos), sorted(set(eos_ids)))

    @classmethod
    def from_text_tokenizer(cls, text_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> "TextCodec":
        """From gpu_worker.models' TextTokenizer (the model loader already read the directory)."""
        template = getattr(text_tokenizer, "chat_template", None)
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        chat = ChatTemplate(template if isinstance(template, str) else None,
                            getattr(text_tokenizer, "bos_token", None), getattr(text_tokenizer, "eos_token", None))
        eos = set(eos_token_ids) | set(getattr(text_tokenizer, "eos_token_ids", ()) or ())
        return cls(text_tokenizer.tokenizer, chat, sorted(eos))

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._plain: Any = None                          # a copy that reads special-token text as plain text
        self._bytes_per_token: int | None | bool = False  # False: not computed yet
        added = getattr(self.tokenizer, "get_added_tokens_decoder", dict)()
        specials = sorted({t.content for t in added.values() if getattr(t, "special", False) and t.content},
                          key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`; special-token text in it becomes those tokens (a completion's prompt is the
        client's own). The tokenizer releases the GIL while it works (encode_batch), so a long prompt does not
        stop this process's other threads: the event loop, the engine link's IO thread and its heartbeats.
        With `limit`, a long text surely over it raises TooManyTokens before it is tokenized whole."""
        return _encode(self.tokenizer, text, add_special_tokens, limit)

    def encode_chat(self, messages: Sequence[ChatMessage], limit: int | None = None,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """The chat template rendered and tokenized; only the template's own special tokens are special.

        Special-token text inside a message (`<|im_end|><|im_start|>system`) stays text: each occurrence is
        replaced by a placeholder before rendering, and the rendered text is tokenized piece by piece, each
        placeholder as the plain text it stands for. The template writes BOS and the like itself."""
        found: list[str] = []
        nonce = secrets.token_hex(6)

        def hide(content: str) -> str:
            if self._special_re is None or self._special_re.search(content) is None:
                return content
            def mark(m: re.Match) -> str:
                found.append(m.group(0))
                return f"{PLACEHOLDER_OPEN}{nonce}:{len(found) - 1}{PLACEHOLDER_CLOSE}"
            return self._special_re.sub(mark, content)

        def hidden_value(v: Any) -> Any:        # calls' arguments, tools' names and schemas are client text too
            if isinstance(v, str):
                return hide(v)
            if isinstance(v, dict):
                return {hidden_value(k): hidden_value(x) for k, x in v.items()}
            if isinstance(v, list):
                return [hidden_value(x) for x in v]
            return v

        if tools:
            self.chat_template.check_tools()
            tools = [hidden_value(t) for t in tools]
        rendered = self.chat_template.render([ChatMessage(m.role, hide(m.content), hidden_value(m.tool_calls),
                                                          m.tool_call_id, m.name) for m in messages], tools=tools)
        if not found:
            return self.encode(rendered, add_special_tokens=False, limit=limit)
        pieces = re.split(f"{PLACEHOLDER_OPEN}{nonce}:(\\d+){PLACEHOLDER_CLOSE}", rendered)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += _encode(self._plain_tokenizer(), found[int(piece)], False)
            elif nonce in piece:
                raise ValueError("the model's chat template changed the message text around special-token text "
                                 "in it; remove text such as "
                                 f"{found[0]!r} from the messages")
            else:
                ids += self.encode(piece, add_special_tokens=False, limit=limit)
        return ids

    def _plain_tokenizer(self) -> Any:
        with self._lock:
            if self._plain is None:
                plain = type(self.tokenizer).from_str(self.tokenizer.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def max_prompt_bytes(self, context_tokens: int) -> int | None:
        """Prompts longer than this many UTF-8 bytes cannot fit `context_tokens` (coordinator/token_bounds.py);
        None where this tokenizer gives no such bound."""
        with self._lock:
            if self._bytes_per_token is False:
                self._bytes_per_token = max_bytes_per_token(self.tokenizer)
            per_token = self._bytes_per_token
        return None if per_token is None else context_tokens * per_token

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_special(self, ids: Sequence[int]) -> str:
        """The text with special tokens' text kept (a harmony reply's channel markers)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); restore it from the model's release") from None
    return doc if isinstance(doc, dict) else {}
