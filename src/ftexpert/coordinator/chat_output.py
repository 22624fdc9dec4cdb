"""A chat reply's text -> OpenAI's assistant message and streamed deltas: the text as `content`, the model's tool
calls (coordinator/tool_calls.py, or harmony.py for a harmony template) as `tool_calls`, a harmony reply's
analysis channel as `reasoning_content` (the field vLLM, llama.cpp and DeepSeek's API use), finish_reason
`tool_calls` when a reply that stopped by itself made calls."""
from __future__ import annotations

from typing import Any

from ftexpert.coordinator.harmony import Reasoning, reply_parser
from ftexpert.coordinator.tool_calls import Tool, ToolCall, ToolChoice


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def chat_message(text: str, tools: list[Tool], choice: ToolChoice, harmony: bool = False) -> tuple[dict[str, Any], bool]:
    """A whole reply -> (the assistant message, whether it made calls)."""
    parser = reply_parser(tools, choice, harmony)
    if parser is None:
        return {"role": "assistant", "content": text}, False
    items = parser.feed_items(text) + parser.finish_items()
    content = "".join(i for i in items if isinstance(i, str))
    calls = [i for i in items if isinstance(i, ToolCall)]
    reasoning = "".join(i.text for i in items if isinstance(i, Reasoning))
    message: dict[str, Any] = {"role": "assistant", "content": content.strip() if calls else content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = [c.openai() for c in calls]
    return message, bool(calls)


class ChatDeltas:
    """One streamed choice: text pieces in, the `delta` objects to send out in the reply's order (content,
    reasoning_content, and each call whole as one `tool_calls` delta with its index, id, name and arguments)."""

    def __init__(self, tools: list[Tool], choice: ToolChoice, harmony: bool = False):
        self._parser = reply_parser(tools, choice, harmony)
        self._calls_sent = 0                     # the index of the next call's delta

    @property
    def made_calls(self) -> bool:
        return self._calls_sent > 0

    @property
    def complete(self) -> bool:
        """The one call a request with parallel_tool_calls false may make has been made: end the generation."""
        return self._parser is not None and self._parser.complete

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self._parser.feed_items(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._parser.finish_items()) if self._parser is not None else []

    def _deltas(self, items: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                out.append({"content": item})
            elif isinstance(item, Reasoning):
                out.append({"reasoning_content": item.text})
            else:
                out.append({"tool_calls": [item.openai(self._calls_sent)]})
                self._calls_sent += 1
        return out
