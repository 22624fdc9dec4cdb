"""A routing trace: per token, every layer's routed expert ids (router rank order) and the lookahead
predictor's ranked candidates (layer L's router applied to layer L-1's router input, L >= 1).

File layout (little-endian)::

    b"FTROUTE1"                       magic and format version
    u32 header length, header JSON    shape, counts, id dtype, payload length and CRC-32
    payload                           zlib of: sequence starts (int64 [S]), experts ([T, L, k]),
                                      candidates ([T, L-1, C]); ids uint8 when E <= 256, else uint16

``read_trace`` checks every length and the checksum and raises ``TraceError`` naming the file for a
file that is not a trace, truncated, or corrupt.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"FTROUTE1"
_U32 = struct.Struct("<I")


class TraceError(ValueError):
    """A routing trace file that cannot be read (the message names the file)."""


@dataclass
class RoutingTrace:
    num_experts: int
    experts: np.ndarray       # [T, L, k] routed ids, rank order
    candidates: np.ndarray    # [T, L-1, C] predictor candidates for layers 1..L-1, rank order
    seq_starts: np.ndarray    # [S] token index where each sequence starts (first is 0)

    def __post_init__(self) -> None:
        t, layers, _ = self.experts.shape
        if self.candidates.shape[:2] != (t, max(0, layers - 1)):
            raise ValueError(f"candidates {self.candidates.shape} do not match experts "
                             f"{self.experts.shape} (want [T, L-1, C])")
        if len(self.seq_starts) == 0 or self.seq_starts[0] != 0 or np.any(np.diff(self.seq_starts) <= 0) \
                or self.seq_starts[-1] >= max(t, 1):
            raise ValueError(f"sequence starts {self.seq_starts[:8]}... must begin at 0 and increase "
                             f"below the token count {t}")
        for name, arr in (("experts", self.experts), ("candidates", self.candidates)):
            if arr.size and (arr.min() < 0 or arr.max() >= self.num_experts):
                raise ValueError(f"{name} holds ids outside 0..{self.num_experts - 1}")

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def num_candidates(self) -> int:
        return self.candidates.shape[2]


def _id_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def write_trace(path: str | Path, trace: RoutingTrace) -> Path:
    path = Path(path)
    ids = _id_dtype(trace.num_experts)
    payload = zlib.compress(b"".join((
        trace.seq_starts.astype("<i8").tobytes(), trace.experts.astype(ids).tobytes(),
        trace.candidates.astype(ids).tobytes())), 6)
    header = json.dumps({
        "num_experts": trace.num_experts, "num_tokens": trace.num_tokens, "num_layers": trace.num_layers,
        "top_k": trace.top_k, "num_candidates": trace.num_candidates,
        "num_sequences": len(trace.seq_starts), "id_dtype": ids.name,
        "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload),
    }).encode()
    path.write_bytes(MAGIC + _U32.pack(len(header)) + header + payload)
    return path


def read_trace(path: str | Path) -> RoutingTrace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read routing trace ({exc.strerror})") from None
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise TraceError(f"{path}: not a routing trace (it does not start with {MAGIC!r}; "
                         f"write one with `python -m ftexpert.workload.routing --trace FILE`)")
    (hlen,) = _U32.unpack_from(data, len(MAGIC))
    body = len(MAGIC) + 4
    if len(data) < body + hlen:
        raise TraceError(f"{path}: truncated routing trace (header of {hlen} bytes, "
                         f"{len(data) - body} present)")
    try:
        h = json.loads(data[body:body + hlen])
        t, layers, k, c, s = (int(h[key]) for key in ("num_tokens", "num_layers", "top_k",
                                                        "num_candidates", "num_sequences"))
        experts_n, plen, crc, ids = int(h["num_experts"]), int(h["payload_bytes"]), int(h["payload_crc32"]), \
            np.dtype(h["id_dtype"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{path}: corrupt routing trace header ({exc})") from None
    payload = data[body + hlen:]
    if len(payload) != plen:
        kind = "truncated" if len(payload) < plen else "corrupt"
        raise TraceError(f"{path}: {kind} routing trace (payload of {plen} bytes expected, "
                         f"{len(payload)} present)")
    if zlib.crc32(payload) != crc:
        raise TraceError(f"{path}: corrupt routing trace (payload checksum mismatch)")
    try:
        raw = zlib.decompress(payload)
    except zlib.error as exc:
        raise TraceError(f"{path}: corrupt routing trace ({exc})") from None
    sizes = (s * 8, t * layers * k * ids.itemsize, t * max(0, layers - 1) * c * ids.itemsize)
    if len(raw) != sum(sizes):
        raise TraceError(f"{path}: corrupt routing trace ({len(raw)} payload bytes, the header "
                         f"describes {sum(sizes)})")
    starts = np.frombuffer(raw, "<i8", s)
    experts = np.frombuffer(raw, ids, t * layers * k, sizes[0]).reshape(t, layers, k)
    cands = np.frombuffer(raw, ids, t * max(0, layers - 1) * c, sizes[0] + sizes[1]).reshape(
        t, max(0, layers - 1), c)
    try:
        return RoutingTrace(experts_n, experts.astype(np.int64), cands.astype(np.int64), starts.copy())
    except ValueError as exc:
        raise TraceError(f"{path}: corrupt routing trace ({exc})") from None
