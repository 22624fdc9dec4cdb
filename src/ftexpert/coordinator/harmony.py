"""gpt-oss's harmony format on the coordinator's side: a reply's messages parsed out of its text, and the grammar
that forces one function call.

A harmony reply is a run of messages, each a header, `<|message|>`, a body and an end marker. The prompt ends
with `<|start|>assistant`, so the reply starts inside the first header:

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient `to=...` may also stand in the role part, `<|start|>assistant to=functions.x<|channel|>...`).
The text comes with its special tokens (the request decodes them: GenerationPlan.harmony). `HarmonyStream` turns it
into items as they are known: `Reasoning` (the analysis channel), text (the final channel, and commentary without
a recipient: a preamble the user sees), and a `ToolCall` (commentary to `functions.<an offered tool>`) when its
message ends. A call body that is not a JSON object, or a recipient that is no offered function (gpt-oss's
built-in browser and python tools are not served), goes out as text, as the Hermes parser keeps a block it cannot
parse. `<|return|>` and `<|call|>` are the model's stop tokens: the request ends there and their text is not in
the reply, so the end of the text ends the last message.

openai-harmony parses the same format; it is not used because it loads its own copy of the o200k vocabulary
(fetched from the network at first use) beside the model's tokenizer, which this server already has
(docs/DEPENDENCIES.md).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ftexpert.coordinator.tool_calls import (CallStream, Tool, ToolCall, ToolChoice, callable_tools, new_call_id,
                                             schema_rule)
from ftexpert.proto.grammar_spec import GrammarSpec

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Reasoning:
    """Text of the analysis channel (the model's reasoning)."""
    text: str


class HarmonyStream:
    """Reply text (special tokens included) in, items out in order; the same interface as tool_calls.CallStream
    (`feed_items`, `finish_items`, `calls`, `complete`: with `single`, the first call ends the reply)."""

    def __init__(self, tools: list[Tool], single: bool = False):
        self._names = {t.name for t in tools}
        self.single = single
        self.complete = False
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_header = True                # the reply starts in its first message's header
        self._header = ""
        self._channel = "final"
        self._recipient: str | None = None
        self._body = ""                       # a call's body, or text of a recipient not served, until its end

    def feed_items(self, piece: str) -> list:
        items: list = []
        if self.complete:
            return items
        self._buf += piece
        while not self.complete:
            m = _MARKER.search(self._buf)
            if m is None:
                keep = _partial_marker_len(self._buf)
                self._add(items, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._add(items, self._buf[:m.start()])
            self._buf = self._buf[m.end():]
            self._marker(items, m.group(0))
        if self.complete:
            self._buf = ""
        return items

    def finish_items(self) -> list:
        """The end of the reply (a stop token, or max_tokens): the message in progress ends here."""
        items: list = []
        if not self.complete:
            self._add(items, self._buf)
            self._buf = ""
            if not self._in_header:
                self._end_message(items)
        return items

    # -------------------------------------------------------------------------------------------- the parser

    def _add(self, items: list, text: str) -> None:
        if not text:
            return
        if self._in_header:
            self._header += text
        elif self._recipient is not None:
            self._body += text
        elif self._channel == "analysis":
            items.append(Reasoning(text))
        else:
            items.append(text)

    def _marker(self, items: list, marker: str) -> None:
        if marker == START:
            if not self._in_header:
                self._end_message(items)
            self._in_header, self._header = True, ""
        elif marker == MESSAGE and self._in_header:
            self._in_header = False
            header = self._header.replace(CONSTRAIN, " ")
            channel = _CHANNEL_NAME.search(header)
            self._channel = channel.group(1) if channel else "final"
            recipient = _RECIPIENT.search(header)
            self._recipient = recipient.group(1) if recipient else None
            self._body = ""
        elif marker in (END, RETURN, CALL) and not self._in_header:
            self._end_message(items)
            self._in_header, self._header = True, ""
        elif self._in_header:
            self._header += marker                  # <|channel|>, <|constrain|> belong to the header
        else:
            self._add(items, marker)               # a marker out of place is text

    def _end_message(self, items: list) -> None:
        recipient, body = self._recipient, self._body
        self._recipient, self._body, self._channel = None, "", "final"
        if recipient is None:
            return
        name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None
        args = _json_object(body) if name in self._names else None
        if args is None:
            if body:
                items.append(body)
            return
        call = ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        items.append(call)
        self.complete = self.single


def _json_object(text: str) -> dict | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _partial_marker_len(s: str) -> int:
    """The length of the longest suffix of `s` that is a proper prefix of a marker."""
    for n in range(min(len(s), max(len(m) for m in MARKERS) - 1), 0, -1):
        if any(m.startswith(s[-n:]) for m in MARKERS):
            return n
    return 0


def reply_parser(tools: list[Tool], choice: ToolChoice, harmony: bool) -> "CallStream | HarmonyStream | None":
    """The parser of a chat reply: harmony's for a harmony template (its channels are parsed with or without
    tools), the Hermes blocks' where tools may be called, none for plain text."""
    offered = callable_tools(tools, choice)
    if harmony:
        return HarmonyStream(offered, single=not choice.parallel)
    return CallStream(offered, single=not choice.parallel) if offered else None


def call_grammar(tools: list[Tool]) -> str:
    """The Lark grammar (llguidance's syntax, special tokens as `<|name|>`) of one harmony call to one of `tools`,
    as the reply's first message: commentary to=functions.<name>, constrained to JSON, the input a JSON value of
    the tool's schema, then `<|call|>` (a stop token: the request ends with the call)."""
    rules = []
    for i, tool in enumerate(tools):
        name = json.dumps(tool.name)
        rules.append(f'call{i}: {name} " " <|constrain|> "json" <|message|> {schema_rule(tool)} <|call|>')
    alts = " | ".join(f"call{i}" for i in range(len(tools)))
    return "\n".join(['start: <|channel|> "commentary to=functions." call', f"call: {alts}", *rules]) + "\n"


def final_message_grammar(spec: GrammarSpec) -> GrammarSpec:
    """`response_format`'s JSON grammar for a harmony reply: the answer as the final channel's message
    (`<|channel|>final<|message|>` then the JSON value; then the model's stop token), so the parser reads it as the
    content. Compact JSON, and a non-strict schema's unimplemented keywords ignored, as for other models."""
    if spec.kind == "json_object":
        schema: dict = {"type": "object"}
    else:
        loaded = json.loads(spec.text)
        schema = loaded if isinstance(loaded, dict) else ({} if loaded else {"not": {}})
    options = {"whitespace_flexible": False, **({} if spec.strict else {"lenient": True})}
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    return GrammarSpec("grammar", f'start: <|channel|> "final" <|message|> %json {json.dumps(schema)}\n')
