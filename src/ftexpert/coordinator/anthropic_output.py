"""A Messages reply's text -> Anthropic content blocks: `text` blocks and the model's tool calls
(coordinator/tool_calls.py) as `tool_use` blocks, each with the stream events that build it.

Text pieces go in as they decode; out come the events of the blocks they complete, in order: a text block opens at
the first text after a call (or at the start), a call closes the text block before it and is sent whole as one
`tool_use` block (content_block_start with an empty input, one `input_json_delta` holding the input's JSON,
content_block_stop). The same object gives the whole reply's `content` for a plain response, so both forms say the
same thing. stop_reason is `tool_use` when a reply that ended by itself made calls. A harmony reply (gpt-oss) is
parsed by harmony.py: its final channel is the text, its analysis channel (reasoning) is left out, as extended
thinking is not served.
"""
from __future__ import annotations

import json
from typing import Any

from ftexpert.coordinator.harmony import reply_parser
from ftexpert.coordinator.tool_calls import Tool, ToolCall, ToolChoice

Event = tuple[str, dict[str, Any]]
TOOL_USE_ID_PREFIX = "toolu_"


def tool_use_id(call: ToolCall) -> str:
    """Anthropic's id form for a call parsed from the reply (tool_calls.new_call_id's hex)."""
    return TOOL_USE_ID_PREFIX + call.id.split("_", 1)[-1]


class MessageBlocks:
    """One reply: text pieces in (`feed`, then `finish`), the stream events out; `content` is the blocks so far."""

    def __init__(self, tools: list[Tool], choice: ToolChoice, harmony: bool = False):
        self._calls = reply_parser(tools, choice, harmony)
        self.content: list[dict[str, Any]] = []
        self._text_open = False                  # the last block is a text block still taking deltas

    @property
    def made_calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)

    @property
    def complete(self) -> bool:
        """The one call a request with disable_parallel_tool_use may make has been made: end the generation."""
        return self._calls is not None and self._calls.complete

    def start(self) -> list[Event]:
        """Without tools a reply is one text block, opened before any text (as Anthropic's stream does)."""
        return [] if self._calls is not None else self._open_text()

    def feed(self, piece: str) -> list[Event]:
        if self._calls is None:
            return self._text(piece)
        return self._items(self._calls.feed_items(piece))

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._calls is not None:
            events = self._items(self._calls.finish_items())
        events += self._close_text()
        if not self.content:                      # an empty reply is one empty text block
            events += self._open_text() + self._close_text()
        return events

    def final_content(self) -> list[dict[str, Any]]:
        """The plain response's content: with calls, text blocks stripped and empty ones left out (as the chat
        route's content is)."""
        if not self.made_calls:
            return self.content
        out = []
        for block in self.content:
            if block["type"] == "text":
                block = {**block, "text": block["text"].strip()}
                if not block["text"]:
                    continue
            out.append(block)
        return out

    def _items(self, items: list[str | ToolCall]) -> list[Event]:
        events: list[Event] = []
        for item in items:
            if isinstance(item, str):
                events += self._text(item)
            elif isinstance(item, ToolCall):
                events += self._call(item)
            # Reasoning (a harmony reply's analysis channel): no thinking blocks, as extended thinking is off
        return events

    def _open_text(self) -> list[Event]:
        index = len(self.content)
        self.content.append({"type": "text", "text": ""})
        self._text_open = True
        return [("content_block_start", {"type": "content_block_start", "index": index,
                                         "content_block": {"type": "text", "text": ""}})]

    def _close_text(self) -> list[Event]:
        if not self._text_open:
            return []
        self._text_open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = [] if self._text_open else self._open_text()
        self.content[-1]["text"] += text
        return events + [("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                  "delta": {"type": "text_delta", "text": text}})]

    def _call(self, call: ToolCall) -> list[Event]:
        events = self._close_text()
        index = len(self.content)
        arguments = json.loads(call.arguments)
        block = {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": arguments}
        self.content.append(block)
        return events + [
            ("content_block_start", {"type": "content_block_start", "index": index,
                                     "content_block": {**block, "input": {}}}),
            ("content_block_delta", {"type": "content_block_delta", "index": index,
                                     "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
            ("content_block_stop", {"type": "content_block_stop", "index": index})]
