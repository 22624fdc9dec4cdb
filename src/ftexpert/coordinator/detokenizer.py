"""Token ids -> text pieces for streaming, and stop strings checked on the decoded text.

IncrementalDetokenizer decodes a small sliding window (the last emitted tokens as context plus the
new ones) so that a token's text is emitted once, whole: a token that ends inside a multi-byte
character (the decoder shows U+FFFD) is held until the character completes. StopStringMatcher holds
back any tail that could still become a stop string, so a stop string is never emitted, not even in
part, and the text before it is.
"""
from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5   # prompt tokens decoded with the first output token (leading-space rules)


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int] = ()):
        self._decode = decode
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self.ids)
        self._prefix = 0                       # window start
        self._read = len(self.ids)             # tokens before this are emitted

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self._num_context:]

    def add(self, token_id: int) -> str:
        """The new text this token completes ('' while a character is still incomplete)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character at the very end), at the end of a request."""
        if self._read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self._hold_max = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now; after a stop string is found, `stopped` is set and the rest dropped."""
        if self.stopped:
            return ""
        if not self.stop:
            return text
        self._pending += text
        first: tuple[int, str] | None = None
        for s in self.stop:
            pos = self._pending.find(s)
            if pos >= 0 and (first is None or pos < first[0]):
                first = (pos, s)
        if first is not None:
            out = self._pending[:first[0]]
            self._pending, self.stopped, self.matched = "", True, first[1]
            return out
        hold = 0
        for n in range(min(self._hold_max, len(self._pending)), 0, -1):
            tail = self._pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                hold = n
                break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of the request (no stop string met): the held tail is ordinary text."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        return out
