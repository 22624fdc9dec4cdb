"""A chat reply's text -> OpenAI's assistant message and streamed deltas: the text as `content`, the model's tool
calls (coordinator/tool_calls.py) as `tool_calls`, finish_reason `tool_calls` when a reply that stopped by itself
made calls."""
from __future__ import annotations

from typing import Any

from ftexpert.coordinator.tool_calls import CallStream, Tool, ToolCall, ToolChoice, callable_tools, split_calls


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def chat_message(text: str, tools: list[Tool], choice: ToolChoice) -> tuple[dict[str, Any], bool]:
    """A whole reply -> (the assistant message, whether it made calls)."""
    offered = callable_tools(tools, choice)
    if not offered:
        return {"role": "assistant", "content": text}, False
    content, calls = split_calls(text, offered, single=not choice.parallel)
    if not calls:
        return {"role": "assistant", "content": content}, False
    return {"role": "assistant", "content": content or None,
            "tool_calls": [c.openai() for c in calls]}, True


class ChatDeltas:
    """One streamed choice: text pieces in, the `delta` objects to send out (content, then each call whole as one
    `tool_calls` delta with its index, id, name and arguments)."""

    def __init__(self, tools: list[Tool], choice: ToolChoice):
        offered = callable_tools(tools, choice)
        self._calls = CallStream(offered, single=not choice.parallel) if offered else None
        self.made_calls = False

    @property
    def complete(self) -> bool:
        """The one call a request with parallel_tool_calls false may make has been made: end the generation."""
        return self._calls is not None and self._calls.complete

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._calls is None:
            return [{"content": text}] if text else []
        return self._deltas(self._calls.feed_items(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._calls.finish_items()) if self._calls is not None else []

    def _deltas(self, items: list[str | ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                out.append({"content": item})
            else:
                out.append({"tool_calls": [item.openai(self._calls.calls.index(item))]})
                self.made_calls = True
        return out
