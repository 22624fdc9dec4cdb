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
import typing
from typing import Any, Union

import msgpack

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


class MessageError(ValueError):
    """A control message does not match the declared schema."""


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


def _check_value(value: Any, annotation: Any) -> bool:
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (str, bytes):
        return isinstance(value, annotation)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_check_value(v, item) for v in value)
    raise TypeError(f"unsupported schema type {annotation!r}")   # a bug in this module


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def encode(msg: Message) -> list[bytes]:
    """[type byte, msgpack map]; checks the fields against the schema first."""
    cls = type(msg)
    if cls not in TYPE_OF_CLASS:
        raise MessageError(f"{cls.__name__} is not a control message")
    payload = {}
    for name, annotation in _hints(cls).items():
        value = getattr(msg, name)
        if isinstance(value, tuple):
            value = list(value)
        if not _check_value(value, annotation):
            raise MessageError(f"{cls.__name__}.{name}={value!r} is not {annotation}")
        payload[name] = value
    return [bytes([TYPE_OF_CLASS[cls]]), msgpack.packb(payload, use_bin_type=True)]


def decode(frames: list[bytes]) -> Message:
    """Inverse of ``encode``; raises MessageError naming what is wrong."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise MessageError(f"a control message is [type byte, msgpack map]; got {len(frames)} frame(s)")
    try:
        cls = MESSAGE_TYPES[MsgType(frames[0][0])]
    except ValueError:
        raise MessageError(f"unknown message type {frames[0][0]}") from None
    try:
        payload = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MessageError(f"{cls.__name__}: payload is not msgpack ({exc})") from None
    if not isinstance(payload, dict):
        raise MessageError(f"{cls.__name__}: payload must be a map, got {type(payload).__name__}")
    hints = _hints(cls)
    unknown = sorted(set(payload) - set(hints))
    if unknown:
        raise MessageError(f"{cls.__name__}: unknown field(s) {', '.join(map(str, unknown))}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in fields.items() if n not in payload
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MessageError(f"{cls.__name__}: missing field(s) {', '.join(missing)}")
    for name, value in payload.items():
        if not _check_value(value, hints[name]):
            raise MessageError(f"{cls.__name__}.{name}={value!r} is not {hints[name]}")
        if hints[name] is float:
            payload[name] = float(value)
    return cls(**payload)
