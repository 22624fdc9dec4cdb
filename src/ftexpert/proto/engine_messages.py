"""The engine link: messages between the coordinator and the GPU worker (ZMQ, typed msgpack, no pickle).

Transport: the coordinator binds a ROUTER socket (``--engine-addr``: by default ipc in a private runtime
directory, or loopback TCP); the GPU worker connects a DEALER whose identity is ``<name>-<pid>``. Every message is two frames, ``[type byte,
msgpack map]`` (proto/typed_messages.py). Prompt token ids travel as packed little-endian int32 bytes.

    worker                                         coordinator
    KNOCK (nonce, protocol)                     ->                  resent every HELLO_RESEND_S until answered
                                                <- CHALLENGE (nonces, the coordinator's proof of the key)
    HELLO (name, pid, protocol,
           the worker's proof of the key)       ->
                                                <- WELCOME (session, store name, CPU channels, timings,
                                                   the engine spec to build) or REJECT ("not authorized",
                                                   another protocol, or a second live worker)
    ... builds the engine the spec describes (heartbeats flow) ...
    READY (facts: device, vocab, context, ...)  ->
                                                <- ADD_REQUEST / ABORT / SET_POLICY / DRAIN / SHUTDOWN
    TOKEN_BATCH (one per engine step)           ->
    REQUEST_FAILED (one request refused)        ->
    STATS (every STATS_INTERVAL_S while busy)   ->
    DRAINED                                     ->   after DRAIN, once idle
    HEARTBEAT                                  <->   both ways, every heartbeat interval
    ERROR (fatal or not)                        ->

KNOCK / CHALLENGE / HELLO's proof is proto/link_auth.py: a peer without the run's key learns nothing, not
even the engine spec. The worker has no engine settings of its own: WELCOME carries the whole `EngineSpec`
(proto/engine_spec.py) the coordinator resolved from its flags and FREETOKEN_* knobs, so the two cannot disagree.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Sequence

import numpy as np

from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.sampling_params import SamplingParams, TokenLogprobs
from ftexpert.proto.typed_messages import MessageCodec, MessageError

ENGINE_PROTOCOL_VERSION = 8            # 5: EngineSpec's forward and engine fields (cuda_graphs, routing, ...); 6: token logprobs and grammars; 7: the spec's cpu_act_quant; 8: its state_checkpoints
HELLO_RESEND_S = 2.0                     # worker: resend HELLO until WELCOME (the coordinator may start later)
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_PEER_TIMEOUT_S = 10.0            # silence after which either side declares the other gone
STATS_INTERVAL_S = 0.1

__all__ = ["MessageError", "SamplingParams", "TokenLogprobs", "CODEC", "encode", "decode", "spec_hash",
           "flatten_stats", "pack_token_ids", "unpack_token_ids", "token_batch"]


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
    proof: bytes              # link_auth.prove(key, WORKER, challenge nonce, worker nonce, ZMQ identity)


@dataclasses.dataclass(frozen=True)
class Welcome:
    session: int              # bumped by every accepted HELLO; READY echoes it
    coordinator_pid: int
    store_name: str           # shared-memory expert store to attach ("" = the strategy needs none)
    cpu_channels: list[str]   # CPU expert workers' channel segments (cpu / hybrid strategies)
    heartbeat_interval_s: float
    peer_timeout_s: float
    spec: EngineSpec          # the engine to build, resolved by the coordinator from its flags and knobs


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
    """Every token one engine step made; parallel lists, finish_reasons "" while running. Logprobs, for the
    requests that asked (empty lists when none did): `lp_counts` per token, -1 for none, else k: `lp_values`
    holds the token's logprob then k alternatives' logprobs, `lp_ids` those k alternatives' ids (in order)."""
    step: int
    request_ids: list[int]
    token_ids: list[int]
    finished: list[bool]
    finish_reasons: list[str]
    lp_counts: list[int] = dataclasses.field(default_factory=list)
    lp_values: list[float] = dataclasses.field(default_factory=list)
    lp_ids: list[int] = dataclasses.field(default_factory=list)

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Each token's logprobs (None where its request did not ask), parallel to token_ids."""
        if not self.lp_counts:
            return [None] * len(self.token_ids)
        if len(self.lp_counts) != len(self.token_ids):
            raise MessageError(f"TokenBatch: {len(self.lp_counts)} logprob counts for {len(self.token_ids)} tokens")
        out: list[TokenLogprobs | None] = []
        v = i = 0
        for k in self.lp_counts:
            if k < 0:
                out.append(None)
                continue
            if v + 1 + k > len(self.lp_values) or i + k > len(self.lp_ids):
                raise MessageError("TokenBatch: fewer logprob values than its counts say")
            out.append(TokenLogprobs(self.lp_values[v], tuple(self.lp_ids[i:i + k]),
                                     tuple(self.lp_values[v + 1:v + 1 + k])))
            v, i = v + 1 + k, i + k
        return out


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
    prefetch: str = ""            # the lookahead prefetch: auto | off | measure | on ("": unchanged)
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


def token_batch(step: int, request_ids: list[int], token_ids: list[int], finished: list[bool],
                finish_reasons: list[str], logprobs: Sequence[TokenLogprobs | None]) -> TokenBatch:
    """A TOKEN_BATCH, its logprobs packed (no list is filled when no token has any)."""
    counts: list[int] = []
    values: list[float] = []
    ids: list[int] = []
    if any(lp is not None for lp in logprobs):
        for lp in logprobs:
            if lp is None:
                counts.append(-1)
                continue
            counts.append(len(lp.top_ids))
            values.append(float(lp.logprob))
            values.extend(float(x) for x in lp.top_logprobs)
            ids.extend(int(t) for t in lp.top_ids)
    return TokenBatch(step, request_ids, token_ids, finished, finish_reasons, counts, values, ids)


def pack_token_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise MessageError(f"packed token ids are {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<i4").tolist()


def spec_hash(spec_wire: dict[str, Any]) -> str:
    """Short, stable hash of an engine spec's agreed part (for logs and the supervisor's HELLO)."""
    text = json.dumps({"protocol": ENGINE_PROTOCOL_VERSION, **spec_wire}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def gpu_worker_supervisor_hash() -> str:
    """What a GPU worker's supervisor-link HELLO carries: it has no settings of its own before WELCOME, so its
    protocol is what its supervisor checks."""
    return hashlib.sha256(f"gpu-worker engine-link protocol {ENGINE_PROTOCOL_VERSION}".encode()).hexdigest()[:16]
