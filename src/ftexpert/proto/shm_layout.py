"""The hot-path channel layout between the GPU worker and one CPU worker (a cross-process contract).

Per CPU worker, one shared-memory segment (proto/shm_segment.py) holding a doorbell and double-buffered
request/response buffers, all at fixed offsets, read and written through numpy / torch views. No
pickling, no sockets. Both ends: proto/cpu_channel.py (the client, GPU side) and
cpu_expert_pool/channel.py (the worker).

Channel region (one segment per CPU worker; offsets in bytes; every array is 4 KiB aligned)::

    0     +------------------------------------------------------------------+
          | common header: magic "FTCHAN01", version, meta_nbytes,           |  64 B
          | creator_pid, creator_start_ticks, state                          |
    64    | meta (msgpack): t_max, hidden, max_triples, hidden_dtype, slots   |  <= 960 B
    1024  | request_seq   i64   written by the client (GPU side)  own line    |  64 B
    1088  | done_seq      i64   written by the worker             own line    |  64 B
    1152  | heartbeat_ns  i64   worker, CLOCK_MONOTONIC, >= every 1 ms idle   |  64 B
    1216  | worker_pid    i64   worker                                       |  64 B
    1280  | worker_epoch  i64   worker: +1 at every worker (re)start          |  64 B
    1344  | worker_state  i64   worker: ABSENT/STARTING/SERVING/STOPPED       |  64 B
    1536  | slot 0 request line: seq i64, layer i32, num_tokens i32,          |  64 B  (client)
          |   num_triples i32, split_limit i32 (@20), split_expert i32 (@24)  |
    1600  | slot 0 response line: seq i64, status i32, num_experts i32,       |  64 B  (worker)
          |                       compute_ns i64                              |
    1664  | slot 1 request line, 1728 slot 1 response line                    |
    4096  +------------------------------------------------------------------+
          | slot 0: hidden    [T_max, H]     hidden_dtype (bf16 or fp32)     |
          |         token_idx [max_triples]  int32                            |
          |         expert_id [max_triples]  int32                            |
          |         weight    [max_triples]  fp32                             |
          |         out       [T_max, H]     fp32 partial sums                |
          | slot 1: the same                                                  |
          +------------------------------------------------------------------+

Slot of a request: ``layer % 2`` (fixed addresses per layer, so a captured CUDA graph can write them).

Split expert: a request may name one expert (split_expert) that the worker computes over its intermediate
channels [0, split_limit) only (the GPU computes the rest). split_limit 0 means no split, whatever
split_expert holds (a 64-bit store of num_triples at offset 16 writes it 0); otherwise it must be in (0, I)
and a multiple of SPLIT_CHANNEL_UNIT, with 0 <= split_expert < E, or the request is a bad request. The
client writes both fields on every request, so no split outlives its request.

State machine of request number n (``request_seq``/``done_seq`` only grow; x86-64 TSO orders the
plain stores below, every counter is an aligned 8-byte word on its own 64-byte line, so the GPU
stream can write/await them with cuStreamWriteValue64 / cuStreamWaitValue64 once the segment is
registered with cudaHostRegister)::

    client                                   worker
    ------                                   ------
    slot s = layer % 2; require slot's        spin on request_seq (hot_ms after the last request),
      previous seq <= done_seq                  then spin spin_us / sleep (growing) / spin ...
    write hidden, triples, request line
      (seq=n, layer, T, N, split)
    request_seq = n        ------------->    sees request_seq >= done_seq + 1 = n
                                             finds the slot whose request seq == n
                                             computes out[:T] = sum_k w_k * FFN_e(x)
                                             response line (seq=n, status, compute_ns)
    spin on done_seq >= n  <-------------   done_seq = n
    check response seq == n, status == OK
    read out[:T] (valid until slot reused)

Worker (re)start: state=STARTING, pid, epoch += 1, done_seq = request_seq (requests of a dead
predecessor are dropped: the client already gave up on them), then SERVING. Clean exit: STOPPED.
The client treats a dead pid (pidfd) as WorkerDead and a passed deadline as WorkerTimeout.

CUDA-graph note for the GPU side: cuStreamWriteValue64 / cuStreamWaitValue64 captured in a graph
replay the constant values of capture time, while request_seq / done_seq grow. Inside a graph, ring
the doorbell from a one-thread kernel that reads a device-side counter (seq = counter + 1, written
through the registered mapping), and wait either with such a kernel or by leaving the join outside
the graph; eagerly, stream memory ops with the host-computed seq work as they are.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ftexpert.proto.shm_segment import (CACHE_LINE_BYTES, COMMON_HEADER_BYTES, PAGE_BYTES, SEGMENT_READY, ShmError,
                               ShmSegment, round_up)

CHANNEL_MAGIC = b"FTCHAN01"
CHANNEL_VERSION = 2             # 2: split_limit, split_expert in the request line
NUM_SLOTS = 2
CHANNEL_META_CAPACITY_BYTES = 1024 - COMMON_HEADER_BYTES
CONTROL_PAGE_BYTES = PAGE_BYTES

# Doorbell words: byte offsets, one 64-byte cache line each.
REQUEST_SEQ_OFFSET = 1024
DONE_SEQ_OFFSET = 1088
HEARTBEAT_NS_OFFSET = 1152
WORKER_PID_OFFSET = 1216
WORKER_EPOCH_OFFSET = 1280
WORKER_STATE_OFFSET = 1344
SLOT_LINES_OFFSET = 1536        # per slot: request line, then response line
SLOT_LINES_BYTES = 2 * CACHE_LINE_BYTES

# worker_state values
WORKER_ABSENT = 0
WORKER_STARTING = 1
WORKER_SERVING = 2
WORKER_STOPPED = 3
WORKER_STATE_NAMES = {WORKER_ABSENT: "absent", WORKER_STARTING: "starting",
                      WORKER_SERVING: "serving", WORKER_STOPPED: "stopped"}

# response status values
STATUS_OK = 0
STATUS_COMPUTE_ERROR = 1       # the kernel raised; details in the worker's log
STATUS_PROTOCOL_ERROR = 2      # request_seq advanced but no slot held that seq
STATUS_BAD_REQUEST = 3         # token index / expert id out of range, too many tokens or triples, a bad split
STATUS_NAMES = {STATUS_OK: "ok", STATUS_COMPUTE_ERROR: "compute error", STATUS_PROTOCOL_ERROR: "protocol error",
                STATUS_BAD_REQUEST: "bad request"}

HIDDEN_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}   # numpy carrier of each (bf16 as u16)
HIDDEN_ITEM_BYTES = {"bfloat16": 2, "float32": 4}

# Request line (client) and response line (worker) of a slot: numpy structured dtypes. split_limit (@20) must
# follow num_triples (@16): a 64-bit store of num_triples covers it and leaves 0 there, i.e. no split.
REQUEST_LINE = np.dtype([("seq", "<i8"), ("layer", "<i4"), ("num_tokens", "<i4"), ("num_triples", "<i4"),
                         ("split_limit", "<i4"), ("split_expert", "<i4")])
RESPONSE_LINE = np.dtype([("seq", "<i8"), ("status", "<i4"), ("num_experts", "<i4"), ("compute_ns", "<i8")])
SPLIT_CHANNEL_UNIT = 32         # split_limit is a multiple of this (the AMX tile's K: 32 bf16)
assert REQUEST_LINE.fields["split_limit"][1] == 20 and REQUEST_LINE.fields["split_expert"][1] == 24
assert REQUEST_LINE.itemsize <= CACHE_LINE_BYTES and RESPONSE_LINE.itemsize <= CACHE_LINE_BYTES


@dataclasses.dataclass(frozen=True)
class ChannelLayout:
    """Byte offsets of one channel; a pure function of (t_max, hidden, max_triples, hidden_dtype)."""

    t_max: int
    hidden: int
    max_triples: int
    hidden_dtype: str

    def __post_init__(self) -> None:
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype {self.hidden_dtype!r} is not supported; use one of "
                             f"{', '.join(HIDDEN_DTYPES)}")
        for field in ("t_max", "hidden", "max_triples"):
            if getattr(self, field) <= 0:
                raise ValueError(f"channel {field} must be > 0, got {getattr(self, field)}")

    @property
    def hidden_bytes(self) -> int:
        return self.t_max * self.hidden * HIDDEN_ITEM_BYTES[self.hidden_dtype]

    @property
    def triple_array_bytes(self) -> int:
        return round_up(self.max_triples * 4, PAGE_BYTES)

    @property
    def out_bytes(self) -> int:
        return self.t_max * self.hidden * 4

    def slot_offsets(self, slot: int) -> dict[str, int]:
        """Byte offsets of slot `slot`'s arrays inside the segment."""
        off = CONTROL_PAGE_BYTES + slot * self.slot_bytes
        offsets = {}
        for name, nbytes in (("hidden", self.hidden_bytes), ("token_idx", self.triple_array_bytes),
                             ("expert_id", self.triple_array_bytes), ("weight", self.triple_array_bytes),
                             ("out", self.out_bytes)):
            offsets[name] = off
            off += round_up(nbytes, PAGE_BYTES)
        return offsets

    @property
    def slot_bytes(self) -> int:
        return (round_up(self.hidden_bytes, PAGE_BYTES) + 3 * self.triple_array_bytes
                + round_up(self.out_bytes, PAGE_BYTES))

    @property
    def nbytes(self) -> int:
        return CONTROL_PAGE_BYTES + NUM_SLOTS * self.slot_bytes

    def meta(self) -> dict[str, Any]:
        return {"t_max": self.t_max, "hidden": self.hidden, "max_triples": self.max_triples,
                "hidden_dtype": self.hidden_dtype, "num_slots": NUM_SLOTS, "nbytes": self.nbytes}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "ChannelLayout":
        try:
            layout = cls(int(meta["t_max"]), int(meta["hidden"]), int(meta["max_triples"]),
                         str(meta["hidden_dtype"]))
        except KeyError as exc:
            raise ShmError(f"channel meta lacks {exc}; recreate the channel with this build") from None
        if meta.get("num_slots") != NUM_SLOTS or meta.get("nbytes") != layout.nbytes:
            raise ShmError("channel meta does not match this build's layout; recreate the channel")
        return layout


@dataclasses.dataclass
class SlotViews:
    request: np.ndarray       # REQUEST_LINE scalar record view (client writes)
    response: np.ndarray      # RESPONSE_LINE scalar record view (worker writes)
    hidden: np.ndarray        # [T_max, H] uint16 (bf16 bits) or float32
    token_idx: np.ndarray     # [max_triples] int32
    expert_id: np.ndarray     # [max_triples] int32
    weight: np.ndarray        # [max_triples] float32
    out: np.ndarray           # [T_max, H] float32


class ChannelViews:
    """numpy views of every field of a channel segment (no copies)."""

    def __init__(self, seg: ShmSegment, layout: ChannelLayout):
        u8 = seg.u8
        self.layout = layout

        def word(offset: int) -> np.ndarray:          # [1] int64 at its own cache line
            return u8[offset:offset + 8].view(np.int64)

        self.request_seq = word(REQUEST_SEQ_OFFSET)
        self.done_seq = word(DONE_SEQ_OFFSET)
        self.heartbeat_ns = word(HEARTBEAT_NS_OFFSET)
        self.worker_pid = word(WORKER_PID_OFFSET)
        self.worker_epoch = word(WORKER_EPOCH_OFFSET)
        self.worker_state = word(WORKER_STATE_OFFSET)
        carrier = HIDDEN_DTYPES[layout.hidden_dtype]
        t_max, h, n = layout.t_max, layout.hidden, layout.max_triples
        self.slots: list[SlotViews] = []
        for s in range(NUM_SLOTS):
            lines = SLOT_LINES_OFFSET + s * SLOT_LINES_BYTES
            off = layout.slot_offsets(s)
            self.slots.append(SlotViews(
                request=u8[lines:lines + REQUEST_LINE.itemsize].view(REQUEST_LINE),
                response=u8[lines + CACHE_LINE_BYTES:lines + CACHE_LINE_BYTES + RESPONSE_LINE.itemsize]
                .view(RESPONSE_LINE),
                hidden=u8[off["hidden"]:off["hidden"] + layout.hidden_bytes].view(carrier).reshape(t_max, h),
                token_idx=u8[off["token_idx"]:off["token_idx"] + n * 4].view(np.int32),
                expert_id=u8[off["expert_id"]:off["expert_id"] + n * 4].view(np.int32),
                weight=u8[off["weight"]:off["weight"] + n * 4].view(np.float32),
                out=u8[off["out"]:off["out"] + layout.out_bytes].view(np.float32).reshape(t_max, h),
            ))


def create_channel(name: str, layout: ChannelLayout) -> ShmSegment:
    """Create a channel segment (its creator, normally the coordinator, owns unlink)."""
    seg = ShmSegment.create(name, nbytes=layout.nbytes, magic=CHANNEL_MAGIC, version=CHANNEL_VERSION,
                            meta=layout.meta(), kind="CPU-worker channel",
                            meta_capacity_bytes=CHANNEL_META_CAPACITY_BYTES)
    seg.set_state(SEGMENT_READY)
    return seg


def attach_channel(name: str) -> tuple[ShmSegment, ChannelLayout]:
    seg = ShmSegment.attach(name, magic=CHANNEL_MAGIC, version=CHANNEL_VERSION, readonly=False,
                            kind="CPU-worker channel",
                            hint="create it first (coordinator, or create_channel) and pass the same name")
    return seg, ChannelLayout.from_meta(seg.meta)


# -- the owner's calls (the coordinator's side: torch-free, it creates the channels before any worker exists) --
DEFAULT_CPU_MAX_TOKENS = 512          # tokens a channel takes (forwards with more fetch every miss: hybrid's prefill chunk)
CHANNEL_HIDDEN_DTYPES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float32"}


def channel_name_for(store_name: str, worker_index: int) -> str:
    """The default channel name of worker `worker_index` of the pool serving `store_name`."""
    return f"{store_name}.cpu{worker_index}"


def channel_hidden_dtype(model_dtype: Any) -> str:
    """The channel carries hidden states in bf16 for bf16 models, else in fp32 (fp16 is widened). `model_dtype`:
    a dtype name ("bfloat16") or a torch dtype (read by its name, so this module needs no torch)."""
    name = str(model_dtype).removeprefix("torch.")
    if name not in CHANNEL_HIDDEN_DTYPES:
        raise ValueError(f"the CPU pool takes bf16, fp16 or fp32 hidden states, not {model_dtype}")
    return CHANNEL_HIDDEN_DTYPES[name]


def create_worker_channel(name: str, *, t_max: int, hidden: int, max_triples: int,
                          hidden_dtype: str = "bfloat16") -> ShmSegment:
    """The owner: create one worker's channel (it outlives worker restarts; unlink it at shutdown)."""
    return create_channel(name, ChannelLayout(t_max, hidden, max_triples, hidden_dtype))
