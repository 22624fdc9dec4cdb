"""The engine link: messages between the coordinator and the GPU worker (ZMQ, typed msgpack, no pickle).

Transport: the coordinator binds a ROUTER socket (``--engine-addr``: by default ipc in a private runtime
directory, or loopback TCP); the GPU worker connects a DEALER whose identity is ``<name>-<pid>``. Every message is two frames, ``[type byte,
msgpack map]`` (proto/typed_messages.py). Prompt token ids travel as packed little-endian int32 bytes.

    worker                                         coordinator
    KNOCK (nonce, protocol)                     ->                  resent every HELLO_RESEND_S until answered
                                                <- CHALLENGE (nonces, the coordinator's proof of the key)
    HELLO (name, pid, config hash + the config,
           the worker's proof of the key)       ->
                                                <- WELCOME (session, store name, CPU channels, timings)
                                                   or REJECT ("not authorized", or which fields differ)
    ... loads the model (heartbeats flow) ...
    READY (facts: device, vocab, context, ...)  ->
                                                <- ADD_REQUEST / ABORT / SET_POLICY / DRAIN / SHUTDOWN
    TOKEN_BATCH (one per engine step)           ->
    REQUEST_FAILED (one request refused)        ->
    STATS (every STATS_INTERVAL_S while busy)   ->
    DRAINED                                     ->   after DRAIN, once idle
    HEARTBEAT                                  <->   both ways, every heartbeat interval
    ERROR (fatal or not)                        ->

KNOCK / CHALLENGE / HELLO's proof is proto/link_auth.py: a peer without the run's key learns nothing, not
even a config hash. The config hash covers what both sides must agree on (engine_config below); it is also the hash the
GPU worker sends on the supervisor link when the coordinator started it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Sequence

import numpy as np

from ftexpert.proto.sampling_params import SamplingParams
from ftexpert.proto.typed_messages import MessageCodec, MessageError

ENGINE_PROTOCOL_VERSION = 3
HELLO_RESEND_S = 2.0                     # worker: resend HELLO until WELCOME (the coordinator may start later)
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_PEER_TIMEOUT_S = 10.0            # silence after which either side declares the other gone
STATS_INTERVAL_S = 0.1
CPU_POOL_STRATEGIES = ("cpu", "hybrid")    # strategies whose misses CPU expert workers compute

__all__ = ["MessageError", "SamplingParams", "CODEC", "encode", "decode", "engine_config", "engine_config_hash",
           "config_diff", "flatten_stats", "pack_token_ids", "unpack_token_ids"]


# ---------------------------------------------------------------- handshake

@dataclasses.dataclass(frozen=True)
class Knock:
    nonce: bytes              # the worker's fresh nonce (link_auth.NONCE_BYTES)
    protocol_version: int


@dataclasses.dataclass(frozen=True)
class Challenge:
    worker_nonce: bytes       # the KNOCK's nonce, echoed
    nonce: bytes              # the coordinator's fresh nonce
    proof: bytes              # link_auth.prove(key, COORDINATOR, worker_nonce, nonce)


@dataclasses.dataclass(frozen=True)
class Hello:
    name: str                 # e.g. "gpu0"
    pid: int
    protocol_version: int
    config_hash: str
    config_json: str          # the hashed config itself, so a mismatch can name the fields that differ
    proof: bytes              # link_auth.prove(key, WORKER, challenge nonce, worker nonce, ZMQ identity)


@dataclasses.dataclass(frozen=True)
class Welcome:
    session: int              # bumped by every accepted HELLO; READY echoes it
    coordinator_pid: int
    store_name: str           # shared-memory expert store to attach ("" = the strategy needs none)
    cpu_channels: list[str]   # CPU expert workers' channel segments (cpu / hybrid strategies)
    heartbeat_interval_s: float
    peer_timeout_s: float


@dataclasses.dataclass(frozen=True)
class Reject:
    reason: str


@dataclasses.dataclass(frozen=True)
class Ready:
    session: int
    pid: int
    device: str               # "cpu", "cuda:0"
    gpu_name: str             # "" on the CPU
    vocab_size: int
    max_context_tokens: int
    max_running_requests: int
    expert_backend: str       # class name of the expert backend in use
    load_time_s: float


# ---------------------------------------------------------------- requests and outputs

@dataclasses.dataclass(frozen=True)
class AddRequest:
    request_id: int
    prompt_ids: bytes         # int32 little-endian (pack_token_ids)
    params: SamplingParams    # as the front door built it (a nested map on the wire)


@dataclasses.dataclass(frozen=True)
class Abort:
    request_ids: list[int]


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """Every token one engine step made; parallel lists, finish_reasons "" while running."""
    step: int
    request_ids: list[int]
    token_ids: list[int]
    finished: list[bool]
    finish_reasons: list[str]


@dataclasses.dataclass(frozen=True)
class RequestFailed:
    request_id: int
    message: str
    retryable: bool = False      # the worker is draining or stopping: another worker (or this one, later) can serve it


@dataclasses.dataclass(frozen=True)
class Stats:
    names: list[str]          # flattened engine stats (dotted names), cumulative counters
    values: list[float]


@dataclasses.dataclass(frozen=True)
class SetPolicy:
    strategy: str
    fetch_fraction: float
    fetch_round: str
    cpu_share_names: list[str]    # the tuner's CPU work split: worker names ...
    cpu_share_values: list[float]  # ... and their shares (empty: keep the current split)
    prefetch: str = ""            # the lookahead prefetch: off | measure | on ("": unchanged)
    prefetch_budget: int = 0      # its experts per layer (0: unchanged)

    def fields(self) -> dict:
        """As keyword arguments of Engine.set_policy (the split as a name -> share dict)."""
        out = dataclasses.asdict(self)
        names, values = out.pop("cpu_share_names"), out.pop("cpu_share_values")
        out["cpu_shares"] = dict(zip(names, values))
        return out


# ---------------------------------------------------------------- lifecycle

@dataclasses.dataclass(frozen=True)
class Drain:
    timeout_s: float          # requests still running after this are aborted


@dataclasses.dataclass(frozen=True)
class Drained:
    finished: int
    aborted: int


@dataclasses.dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    pass


@dataclasses.dataclass(frozen=True)
class Error:
    message: str
    fatal: bool


MESSAGE_TYPES: dict[int, type] = {
    1: Hello, 2: Welcome, 3: Reject, 4: Ready, 5: AddRequest, 6: Abort, 7: TokenBatch, 8: RequestFailed,
    9: Stats, 10: SetPolicy, 11: Drain, 12: Drained, 13: Shutdown, 14: Heartbeat, 15: Error, 16: Knock, 17: Challenge,
}
CODEC = MessageCodec("engine link", MESSAGE_TYPES)
encode = CODEC.encode
decode = CODEC.decode


# ---------------------------------------------------------------- helpers

def flatten_stats(obj: Any, prefix: str = "", out: dict[str, float] | None = None, depth: int = 0) -> dict[str, float]:
    """Every finite number in a stats object (dict / dataclass / attributes), as dotted names (STATS' names)."""
    out = {} if out is None else out
    if depth > 4:
        return out
    if isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, (int, float)):
        if math.isfinite(obj):
            out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten_stats(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flatten_stats(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name, out, depth + 1)
    elif hasattr(obj, "__dict__") and not callable(obj):
        for k, v in vars(obj).items():
            if not k.startswith("_"):
                flatten_stats(v, f"{prefix}.{k}" if prefix else k, out, depth + 1)
    elif hasattr(obj, "item") and callable(obj.item):  # 0-d tensor / numpy scalar
        try:
            flatten_stats(obj.item(), prefix, out, depth + 1)
        except (TypeError, ValueError, RuntimeError):
            pass
    return out


def pack_token_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise MessageError(f"packed token ids are {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<i4").tolist()


def engine_config(*, model: str | None, preset: str | None, dtype: str, moe_strategy: str,
                  moe_cache_size: str | None, max_running_requests: int, max_context_tokens: int | None,
                  num_cpu_workers: int, expert_format: str = "auto") -> dict[str, Any]:
    """What the coordinator and its GPU worker must agree on (from their command-line flags).
    num_cpu_workers counts only for the strategies that use CPU expert workers; expert_format (--expert-format,
    FREETOKEN_EXPERT_FORMAT) is normalised (int4 = int4-g128)."""
    return {"protocol": ENGINE_PROTOCOL_VERSION, "model": model or "", "preset": preset or "", "dtype": dtype,
            "expert_format": expert_format_label(expert_format),
            "moe_strategy": moe_strategy, "moe_cache_size": "" if moe_cache_size is None else str(moe_cache_size),
            "max_running_requests": int(max_running_requests),
            "max_context_tokens": 0 if max_context_tokens is None else int(max_context_tokens),
            "num_cpu_workers": int(num_cpu_workers) if moe_strategy in CPU_POOL_STRATEGIES else 0}


def expert_format_label(text: str | None) -> str:
    """An --expert-format value as the engine config holds it: auto, or the format's label (int4 -> int4-g128)."""
    if text is None or str(text).strip().lower() in ("", "auto"):
        return "auto"
    from ftexpert.proto.expert_format import ExpertFormat
    return ExpertFormat.parse(str(text)).label


def config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def engine_config_hash(config: dict[str, Any]) -> str:
    """Short, stable hash (the same function as proto.supervised_child.config_hash)."""
    return hashlib.sha256(config_json(config).encode("utf-8")).hexdigest()[:16]


def differing_fields(ours: dict[str, Any], theirs_json: str) -> list[str]:
    """The names of the fields that differ (what a REJECT may tell an authenticated worker; no values, no hash)."""
    try:
        theirs = json.loads(theirs_json)
    except ValueError:
        return ["<unreadable config>"]
    if not isinstance(theirs, dict):
        return ["<unreadable config>"]
    return sorted(k for k in set(ours) | set(theirs) if ours.get(k, "<absent>") != theirs.get(k, "<absent>"))


def config_diff(ours: dict[str, Any], theirs_json: str) -> str:
    """'field: ours=X, worker=Y; ...' for every field that differs (for error messages)."""
    try:
        theirs = json.loads(theirs_json)
    except ValueError:
        return "the worker sent no readable config"
    if not isinstance(theirs, dict):
        return "the worker sent no readable config"
    keys = sorted(set(ours) | set(theirs))
    parts = [f"{k}: coordinator={ours.get(k, '<absent>')!r}, worker={theirs.get(k, '<absent>')!r}"
             for k in keys if ours.get(k, "<absent>") != theirs.get(k, "<absent>")]
    return "; ".join(parts) or "the configs are equal but were hashed differently (another ft version?)"
