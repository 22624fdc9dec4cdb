"""Logprobs from the engine to OpenAI's shapes.

`LogprobTrail` ties each token's logprobs (proto/sampling_params.py `TokenLogprobs`, as the GPU worker's sampler
reported them) to the text it made, so that a response's logprobs and its text agree: a chunk carries the
logprobs of the tokens whose text it completes (text that the detokenizer holds for an incomplete character, or
that could still begin a stop string, holds its tokens back too). When a stop string ends the text, the tokens
whose text begins before it are listed and those wholly inside or after it are not; the stop token (EOS, a stop
token id) is never listed, as its text is not shown.

`TokenPieces` gives a token's bytes and its display text; `chat_logprobs` / `completion_logprobs` build
``choices[].logprobs`` of /v1/chat/completions and /v1/completions.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ftexpert.proto.sampling_params import TokenLogprobs

SENTENCEPIECE_SPACE = "\u2581"


@dataclass
class LogprobEntry:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]      # the most likely alternatives (id, logprob), best first
    offset: int                       # characters of the choice's text before this token's text
    end: int | None = None            # ... and up to the end of its text (None: its character is not complete)


class LogprobTrail:
    """One request's tokens with logprobs, released as their text is emitted."""

    def __init__(self) -> None:
        self._pending: list[LogprobEntry] = []
        self._decoded = 0             # characters the detokenizer has produced
        self._emitted = 0             # characters sent to the client

    def add(self, token_id: int, logprobs: TokenLogprobs | None, piece: str) -> None:
        """A token and the text the detokenizer gave for it ('' while its character is incomplete)."""
        if logprobs is not None:
            self._pending.append(LogprobEntry(token_id, logprobs.logprob,
                                              list(zip(logprobs.top_ids, logprobs.top_logprobs)), self._decoded))
        self.text(piece)

    def text(self, piece: str) -> None:
        """More decoded text: it completes every pending token's text."""
        if piece:
            self._decoded += len(piece)
            for entry in self._pending:
                if entry.end is None:
                    entry.end = self._decoded

    def emit(self, text: str) -> list[LogprobEntry]:
        """`text` goes to the client: the tokens whose text it completes."""
        self._emitted += len(text)
        n = 0
        while n < len(self._pending) and self._pending[n].end is not None and self._pending[n].end <= self._emitted:
            n += 1
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def finish(self, text: str, stopped: bool) -> list[LogprobEntry]:
        """The last `text` goes to the client: every token left, or where a stop string ended the text (`stopped`)
        those whose text begins before it."""
        self._emitted += len(text)
        out = [e for e in self._pending if not stopped or e.offset < self._emitted]
        self._pending = []
        return out


class TokenPieces:
    """A token's bytes (byte-level BPE: through the byte alphabet; SentencePiece: U+2581 as space, <0xNN> as the
    byte) and its text (the bytes as UTF-8, or 'bytes:\\xNN...' where they are not whole characters)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._byte_level = '"ByteLevel"' in json.dumps(json.loads(tokenizer.to_str()).get("decoder"))
        self._unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            raw = b""
        elif self._byte_level and all(c in self._unicode_to_byte for c in piece):
            raw = bytes(self._unicode_to_byte[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")
        if len(self._cache) < 1 << 20:
            self._cache[token_id] = raw
        return raw

    def text_of(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet of byte-level BPE (printable bytes as themselves, the rest from U+0100 up)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def chat_logprobs(entries: list[LogprobEntry], pieces: TokenPieces) -> dict[str, Any]:
    """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": pieces.text_of(token_id), "logprob": logprob, "bytes": list(pieces.bytes_of(token_id))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[LogprobEntry], pieces: TokenPieces) -> dict[str, Any]:
    """Completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``: each top_logprobs dict holds the
    asked-for alternatives and the sampled token (as OpenAI's legacy API: up to logprobs + 1 entries)."""
    top = []
    for e in entries:
        alternatives = {pieces.text_of(t): lp for t, lp in e.top}
        alternatives.setdefault(pieces.text_of(e.token_id), e.logprob)
        top.append(alternatives)
    return {"tokens": [pieces.text_of(e.token_id) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}
