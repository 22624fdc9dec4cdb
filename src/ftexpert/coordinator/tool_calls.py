"""Tool calling on the coordinator's side: the tools a request offers (OpenAI's `tools` / `tool_choice`, checked
field by field), and the model's calls parsed out of the text it writes.

The model's chat template renders the tools (tokenizer_config.json's `chat_template`, given `tools` as
transformers gives them); the built-in ChatML format renders them itself. The output format is the one of the
Qwen / Hermes family of templates, which the embedded model's template uses too: a call is

    <tool_call>
    {"name": "<function name>", "arguments": {<the arguments object>}}
    </tool_call>

anywhere in the reply, one block per call. `split_calls` cuts a whole reply into its text and its calls;
`CallStream` does the same on a stream of text pieces, holding back only what could still begin a block. A block
whose JSON does not parse, or that names no offered tool, stays text (the client sees what the model wrote).
Templates of another family (gpt-oss's harmony channels) are refused with a clear error rather than parsed wrongly.

`tool_choice` "required" or a named function constrains the reply to one call block (`call_grammar`: a Lark
grammar for the sampler's grammar mask, proto/grammar_spec.py): the call's name is one of the tools, its arguments
match that tool's schema, so even a model that never learnt the format answers with a valid call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 << 10
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")          # OpenAI's rule for a function name
TOOL_CHOICE_MODES = ("auto", "none", "required")


class ToolError(ValueError):
    """A bad tool definition or choice; `param` names the field (the front door maps it to a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict        # the JSON schema of the arguments object

    def openai(self) -> dict:
        """The OpenAI form chat templates are given (`tools`)."""
        described = {"description": self.description} if self.description else {}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"              # auto | none | required | function
    name: str | None = None         # mode "function": the one the model must call
    parallel: bool = True           # False: at most one call (generation ends when the first call closes)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str                  # the arguments object as JSON text

    def openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -------------------------------------------------------------------------------------------- definitions

def check_schema(schema: Any, where: str) -> dict:
    """A tool's `parameters`: a JSON schema object describing an object (the arguments). Only the shape is
    checked here; the grammar engine compiles it when a call is constrained."""
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ToolError(f"'{where}' must be a JSON schema object, got {type(schema).__name__}", where)
    kind = schema.get("type", "object")
    if kind != "object":
        raise ToolError(f"'{where}.type' must be \"object\" (a function takes an arguments object), got {kind!r}",
                        f"{where}.type")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ToolError(f"'{where}' is over {MAX_SCHEMA_BYTES} bytes of JSON; shorten the schema", where)
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ToolError(f"'{where}.properties' must be an object mapping names to schemas", f"{where}.properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"'{where}.required' must be a list of property names", f"{where}.required")
    return schema


def parse_tool(raw: Any, where: str) -> Tool:
    """One OpenAI tool: {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}."""
    if not isinstance(raw, dict):
        raise ToolError(f"'{where}' must be an object {{\"type\": \"function\", \"function\": {{...}}}}", where)
    if raw.get("type") != "function":
        raise ToolError(f"'{where}.type' must be \"function\" (the only tool type served), got {raw.get('type')!r}",
                        f"{where}.type")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"'{where}.function' must be an object with 'name' and 'parameters'", f"{where}.function")
    return make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function",
                     schema_key="parameters")


def make_tool(name: Any, description: Any, schema: Any, where: str, schema_key: str) -> Tool:
    """A tool from its parts (OpenAI's function object, Anthropic's tool); `where` names its object."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r}", f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"'{where}.description' must be a string", f"{where}.description")
    return Tool(name, description or "", check_schema(schema, f"{where}.{schema_key}"))


def _tool_list(body: dict, parse: Any, form: str) -> list[Tool]:
    """`tools`: a list of at most MAX_TOOLS tools, each parsed by `parse(raw, where)`, names unique."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ToolError(f"'tools' must be a list of {form} objects", "tools")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"'tools' has {len(raw)} tools; at most {MAX_TOOLS} are allowed", "tools")
    tools = [parse(t, f"tools[{i}]") for i, t in enumerate(raw)]
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"'tools' names the function {dup!r} twice; each name must be unique", "tools")
    return tools


def _flag(value: Any, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ToolError(f"'{name}' must be true or false, got {value!r}", name)
    return value


def parse_openai_tools(body: dict) -> tuple[list[Tool], ToolChoice]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request -> the tools and the choice (auto without
    tools is none)."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise ToolError(f"'{name}' is the deprecated form of tool calling; send 'tools' and 'tool_choice'", name)
    tools = _tool_list(body, parse_tool, '{"type": "function", "function": {...}}')
    choice = parse_tool_choice(body.get("tool_choice"), [t.name for t in tools])
    parallel = _flag(body.get("parallel_tool_calls"), "parallel_tool_calls", True)
    return tools, ToolChoice(choice.mode, choice.name, parallel)


# Anthropic's tool_choice types -> ToolChoice modes
ANTHROPIC_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def parse_anthropic_tool(raw: Any, where: str) -> Tool:
    """One Anthropic client tool: {"name", "description"?, "input_schema", "type"?: "custom", "cache_control"?}.
    Server tools (web search, code execution, ...) run at Anthropic, not here: refused."""
    if not isinstance(raw, dict):
        raise ToolError(f"'{where}' must be an object {{\"name\": ..., \"description\": ..., \"input_schema\": "
                        f"{{...}}}}", where)
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise ToolError(f"'{where}.type' is {str(kind)[:100]!r}: server tools run on Anthropic's side and are not served "
                        f"here; send client tools ({{\"name\", \"description\", \"input_schema\"}}, type \"custom\" or "
                        f"none)", f"{where}.type")
    if raw.get("input_schema") is None:
        raise ToolError(f"'{where}.input_schema' is required: the JSON schema of the tool's input object, such as "
                        f"{{\"type\": \"object\", \"properties\": {{...}}}}", f"{where}.input_schema")
    return make_tool(raw.get("name"), raw.get("description"), raw.get("input_schema"), where,
                     schema_key="input_schema")


def parse_anthropic_tools(body: dict) -> tuple[list[Tool], ToolChoice]:
    """`tools` and `tool_choice` of a Messages request -> the tools and the choice: auto / any (a call is
    required) / tool (that one) / none, and `disable_parallel_tool_use` (at most one call)."""
    tools = _tool_list(body, parse_anthropic_tool, '{"name": ..., "input_schema": {...}}')
    names = [t.name for t in tools]
    raw = body.get("tool_choice")
    if raw is None:
        return tools, ToolChoice("auto" if names else "none")
    kinds = ", ".join(repr(k) for k in ANTHROPIC_CHOICES)
    if not isinstance(raw, dict) or raw.get("type") not in ANTHROPIC_CHOICES:
        raise ToolError(f"'tool_choice' must be an object whose 'type' is one of {kinds}, such as "
                        f"{{\"type\": \"auto\"}}", "tool_choice")
    mode = ANTHROPIC_CHOICES[raw["type"]]
    if mode != "none" and not names:
        raise ToolError(f"'tool_choice' of type {raw['type']!r} needs 'tools'; send the tools the model may call",
                        "tool_choice")
    name = None
    if mode == "function":
        name = raw.get("name")
        if name not in names:
            raise ToolError(f"'tool_choice.name' {name!r} is not one of the tools ({', '.join(names)})",
                            "tool_choice.name")
    parallel = not _flag(raw.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use", False)
    return tools, ToolChoice(mode, name, parallel)


def parse_tool_choice(raw: Any, names: list[str]) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(raw, str):
        if raw not in TOOL_CHOICE_MODES:
            raise ToolError(f"'tool_choice' must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {raw!r}", "tool_choice")
        if raw != "none" and not names:
            raise ToolError(f"'tool_choice' {raw!r} needs 'tools'; send the tools the model may call",
                            "tool_choice")
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name not in names:
            raise ToolError(f"'tool_choice.function.name' {name!r} is not one of the tools ({', '.join(names) or 'none'})",
                            "tool_choice.function.name")
        return ToolChoice("function", name)
    raise ToolError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def call_grammar(tools: list[Tool]) -> str:
    """The Lark grammar (llguidance's syntax) of one call block to one of `tools`, in the form `split_calls` parses:
    the literal tags and name, the arguments a JSON value of the tool's schema (compact)."""
    rules = []
    for i, tool in enumerate(tools):
        name = json.dumps(json.dumps(tool.name))[1:-1]            # the name as JSON, escaped for a Lark string
        rules.append(f'call{i}: "{{\\"name\\": {name}, \\"arguments\\": " {schema_rule(tool)} "}}"')
    alts = " | ".join(f"call{i}" for i in range(len(tools)))
    return "\n".join([f'start: "{OPEN_TAG}\\n" call "\\n{CLOSE_TAG}"', f"call: {alts}", *rules]) + "\n"


def schema_rule(tool: Tool) -> str:
    """The Lark item of a call's arguments: a JSON value of the tool's schema, compact."""
    return f"%json {json.dumps({**tool.parameters, 'x-guidance': {'whitespace_flexible': False}})}"


def callable_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools the model may call under `choice` (a named choice: that one)."""
    if choice.mode == "none":
        return []
    if choice.mode == "function":
        return [t for t in tools if t.name == choice.name]
    return list(tools)


# -------------------------------------------------------------------------------------------- the output

def _parse_block(body: str, names: set[str]) -> ToolCall | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("name") not in names:
        return None
    args = doc.get("arguments", doc.get("parameters", {}))
    if isinstance(args, str):            # a model that wrote the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), doc["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class CallStream:
    """Text pieces in, the reply's items out in order as soon as they are known (`feed_items`: text strings and
    ToolCalls): text outside the blocks goes out at once except a tail that could still start `<tool_call>`; a
    block goes out as one call when its close tag arrives (or, at the end, as text when it never closes or does not
    parse). After a call, whitespace alone is held until text follows it, and dropped at the end: the whitespace
    between and after calls is not content. `single`: the first call completes the reply (`complete`); what
    follows it is dropped. `feed` / `finish` give the same as (text, calls), for consumers that need no order."""
    tools: list[Tool]
    single: bool = False
    complete: bool = False
    _names: set[str] = field(init=False)
    _buf: str = ""
    _in_block: bool = False
    _ws: str = ""                                # whitespace after a call, held
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._names = {t.name for t in self.tools}

    def feed_items(self, piece: str) -> list[str | ToolCall]:
        items: list[str | ToolCall] = []
        if self.complete:
            return items
        self._buf += piece
        while not self.complete:
            if self._in_block:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(CLOSE_TAG):]
                self._in_block = False
                call = _parse_block(body.strip(), self._names)
                if call is None:
                    self._text(items, OPEN_TAG + body + CLOSE_TAG)
                else:
                    self._call(items, call)
                continue
            start = self._buf.find(OPEN_TAG)
            if start >= 0:
                self._text(items, self._buf[:start])
                self._buf = self._buf[start + len(OPEN_TAG):]
                self._in_block = True
                continue
            keep = _partial_tag_len(self._buf)
            self._text(items, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        if self.complete:
            self._buf, self._in_block = "", False
        return items

    def finish_items(self) -> list[str | ToolCall]:
        """The end of the reply: what was held back goes out as text."""
        items: list[str | ToolCall] = []
        if not self.complete:
            self._text(items, (OPEN_TAG + self._buf) if self._in_block else self._buf)
        self._buf, self._in_block, self._ws = "", False, ""
        return items

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        return _pair(self.feed_items(piece))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return _pair(self.finish_items())

    def _text(self, items: list, text: str) -> None:
        if not text:
            return
        if self.calls:
            if not text.strip():
                self._ws += text
                return
            text, self._ws = self._ws + text, ""
        items.append(text)

    def _call(self, items: list, call: ToolCall) -> None:
        self._ws = ""
        self.calls.append(call)
        items.append(call)
        self.complete = self.single


def _pair(items: list[str | ToolCall]) -> tuple[str, list[ToolCall]]:
    return "".join(i for i in items if isinstance(i, str)), [i for i in items if isinstance(i, ToolCall)]


def _partial_tag_len(s: str) -> int:
    """The length of the longest suffix of `s` that is a proper prefix of OPEN_TAG."""
    for n in range(min(len(s), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(s[-n:]):
            return n
    return 0


def split_calls(text: str, tools: list[Tool], single: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (its text without the call blocks, stripped where calls were found; the calls; with
    `single`, only the first call and nothing after it)."""
    stream = CallStream(tools, single)
    a, calls = stream.feed(text)
    b, _ = stream.finish()
    content = a + b
    return (content.strip() if calls else content), calls
