"""Control messages between the coordinator and CPU expert workers (ZMQ, never on the hot path).

Wire format: two frames, ``[type byte, msgpack map]``. The map's keys are exactly the fields of the
message's dataclass below (declared types, checked on decode; unknown or missing fields are errors).
No pickle anywhere. Large arrays (the expert owner map) travel as msgpack ``bin``.

Conversation (worker = ZMQ DEALER connected to the coordinator's ROUTER at ``--control``)::

    worker                               coordinator
    HELLO (facts, store config hash)  ->
                                      <- CONFIG (settings, expert split)   [or SHUTDOWN: wrong hash]
    READY (kernel, threads, warm-up)  ->
                                      <- STATS_REQUEST            -> STATS
                                      <- REBALANCE (new split)    -> REBALANCED
                                      <- SHUTDOWN                 (worker drains and exits 0)
    ERROR (fatal or not)              ->   at any time
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Union

from .typed_messages import MessageCodec, MessageError  # noqa: F401  (MessageError re-exported)

PROTOCOL_VERSION = 1


class MsgType(enum.IntEnum):
    HELLO = 1
    CONFIG = 2
    READY = 3
    STATS_REQUEST = 4
    STATS = 5
    REBALANCE = 6
    REBALANCED = 7
    SHUTDOWN = 8
    ERROR = 9


@dataclasses.dataclass(frozen=True)
class Hello:
    """Worker -> coordinator, first message after connecting."""
    worker_index: int
    num_workers: int
    pid: int
    protocol_version: int
    store_name: str
    config_hash: str          # the expert store's config hash, as found in the store
    channel_name: str
    node_id: int
    cpus: list[int]
    compute_cpus: list[int]
    cpu_features: list[str]   # e.g. ["avx512f", "avx512_bf16", "amx_bf16"]
    native_kernel: str        # ISA of the compiled kernel available here, "" when none


@dataclasses.dataclass(frozen=True)
class Config:
    """Coordinator -> worker. Every field has the worker's default; send only what you change."""
    kernel: str = "auto"              # auto | torch | native | native-<isa> (see expert_kernel.KERNELS)
    num_threads: int = 0              # 0 = one per physical core of the placement
    spin_us: float = 50.0             # idle: spin this long between sleeps
    hot_ms: float = 50.0              # after a request: spin continuously this long
    sleep_min_us: float = 20.0        # idle sleeps grow from this ...
    sleep_max_us: float = 1000.0      # ... to this
    heartbeat_interval_ms: float = 1.0
    split_epoch: int = 0
    owner_map: bytes = b""            # int16 [L * E]: worker index of each (layer, expert); b"" = unchanged


@dataclasses.dataclass(frozen=True)
class Ready:
    """Worker -> coordinator: serving the channel."""
    worker_index: int
    pid: int
    config_hash: str
    kernel: str                       # the kernel actually in use, e.g. "native-avx512_bf16" or "torch"
    num_threads: int
    warmup_gbps: float                # weight bytes per second of a warm-up call (0 when skipped)
    split_epoch: int
    channel_epoch: int


@dataclasses.dataclass(frozen=True)
class StatsRequest:
    pass


@dataclasses.dataclass(frozen=True)
class Stats:
    worker_index: int
    requests: int
    tokens: int
    triples: int
    expert_calls: int                 # (request, expert) groups computed
    weight_bytes: int                 # expert bytes read
    compute_ns: int
    errors: int
    foreign_triples: int              # triples for experts the split gives to another worker
    split_epoch: int
    uptime_s: float


@dataclasses.dataclass(frozen=True)
class Rebalance:
    split_epoch: int
    owner_map: bytes                  # int16 [L * E]


@dataclasses.dataclass(frozen=True)
class Rebalanced:
    worker_index: int
    split_epoch: int
    num_owned: int                    # (layer, expert) pairs this worker owns now


@dataclasses.dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Error:
    worker_index: int
    message: str
    fatal: bool


Message = Union[Hello, Config, Ready, StatsRequest, Stats, Rebalance, Rebalanced, Shutdown, Error]

MESSAGE_TYPES: dict[MsgType, type] = {
    MsgType.HELLO: Hello, MsgType.CONFIG: Config, MsgType.READY: Ready,
    MsgType.STATS_REQUEST: StatsRequest, MsgType.STATS: Stats, MsgType.REBALANCE: Rebalance,
    MsgType.REBALANCED: Rebalanced, MsgType.SHUTDOWN: Shutdown, MsgType.ERROR: Error,
}
TYPE_OF_CLASS: dict[type, MsgType] = {cls: t for t, cls in MESSAGE_TYPES.items()}


_CODEC = MessageCodec("CPU worker control", {int(t): cls for t, cls in MESSAGE_TYPES.items()})


def encode(msg: Message) -> list[bytes]:
    """[type byte, msgpack map]; checks the fields against the schema first."""
    return _CODEC.encode(msg)


def decode(frames: list[bytes]) -> Message:
    """Inverse of ``encode``; raises MessageError naming what is wrong."""
    return _CODEC.decode(frames)
