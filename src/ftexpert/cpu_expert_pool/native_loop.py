"""The worker's hot loop in C (``ft_serve`` in cpu_expert_pool/native/serve_loop.c), bound to one channel.

``NativeServeLoop.run(deadline_ns, hot_ns, last_work_ns)`` answers requests in C until the deadline
(the Python loop's housekeeping), an idle stretch of ``hot_ns`` (the idle policy takes over), or a
request that Python must answer (malformed, an invalid split, no slot, a kernel error: left in place, so
the Python path's ``next_request()`` finds it next). A request's split expert (split_limit, split_expert
of the request line) is passed to the kernel as it is. The Python loop cost ~5-6 us a request before any compute,
which on the GPU -> CPU -> GPU hand-off decides whether the GPU's first poll (a ~4 us PCIe round trip)
already finds the answer (docs/HYBRID.md). A quantized store's requests go to ft_moe_layer_q (quant_ffn.c) with
the store's format descriptor; both kernels get the store's activation descriptor (act_desc.py: gpt-oss's clamped
SwiGLU and biases; none for silu).

Used when the worker's kernel is the compiled one (the torch kernel keeps the Python path), unless
FT_WORKER_LOOP=python says otherwise (for comparisons).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from ftexpert.cpu_expert_pool.channel import WorkerChannel
from ftexpert.cpu_expert_pool.native.act_desc import ExpertActDesc, act_address
from ftexpert.cpu_expert_pool.native.build import NativeLib
from ftexpert.cpu_expert_pool.native.quant_desc import QuantFormatDesc
from ftexpert.proto.expert_owners import ExpertSplit
from ftexpert.proto.expert_store import ExpertStore
from ftexpert.proto.shm_layout import NUM_SLOTS

SERVE_DEADLINE, SERVE_IDLE, SERVE_PYTHON = 0, 1, 2
# ft_serve's stats[] in order; the names are WorkerStats' fields.
STAT_FIELDS = ("requests", "tokens", "triples", "expert_calls", "weight_bytes", "compute_ns", "foreign_triples")
LOOP_ENV = "FT_WORKER_LOOP"            # native (default where the compiled kernel runs) | python

_P2 = ctypes.c_void_p * NUM_SLOTS


class ChannelDesc(ctypes.Structure):
    """Mirror of serve_loop.c's ft_channel_desc (its size and every field's offset checked at construction)."""
    _fields_ = [
        ("request_seq", ctypes.c_void_p), ("done_seq", ctypes.c_void_p),
        ("request_line", _P2), ("response_line", _P2),
        ("hidden", _P2), ("token_idx", _P2), ("expert_id", _P2), ("weight", _P2), ("out", _P2),
        ("t_max", ctypes.c_int64), ("max_triples", ctypes.c_int64), ("hidden_is_bf16", ctypes.c_int64),
        ("store_data", ctypes.c_void_p), ("expert_stride", ctypes.c_int64),
        ("num_layers", ctypes.c_int64), ("num_experts", ctypes.c_int64), ("hidden_size", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("owner", ctypes.c_void_p), ("worker_index", ctypes.c_int64),
        ("isa", ctypes.c_int64), ("num_threads", ctypes.c_int64),
        ("quant_format", ctypes.c_void_p), ("act", ctypes.c_void_p),
    ]


def native_loop_wanted() -> bool:
    value = os.environ.get(LOOP_ENV, "native")
    if value not in ("native", "python"):
        raise ValueError(f"{LOOP_ENV}={value!r}: use native or python")
    return value == "native"


def _addr(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


class NativeServeLoop:
    """One channel's C loop; rebuild it when the kernel (ISA, threads) or the expert split changes."""

    def __init__(self, lib: NativeLib, channel: WorkerChannel, store: ExpertStore, *, isa: int, num_threads: int,
                 split: ExpertSplit | None, worker_index: int, quant_format: QuantFormatDesc | None = None,
                 act: ExpertActDesc | None = None):
        size, offsets = lib.channel_desc_size(), lib.channel_desc_offsets()
        mirror = [getattr(ChannelDesc, name).offset for name, _ in ChannelDesc._fields_]
        if size != ctypes.sizeof(ChannelDesc) or offsets != mirror:
            raise RuntimeError(f"serve_loop.c's ft_channel_desc ({size} bytes, offsets {offsets}) does not match "
                               f"its ctypes mirror ({ctypes.sizeof(ChannelDesc)} bytes, offsets {mirror}): the two "
                               "must change together")
        views, layout = channel.views, channel.layout
        if store.shape.hidden != layout.hidden:
            raise ValueError(f"channel hidden size {layout.hidden} != store's {store.shape.hidden}")
        self._lib, self._channel = lib, channel
        d = ChannelDesc()
        d.request_seq, d.done_seq = _addr(views.request_seq), _addr(views.done_seq)
        for s, slot in enumerate(views.slots):
            d.request_line[s], d.response_line[s] = _addr(slot.request), _addr(slot.response)
            d.hidden[s], d.token_idx[s], d.expert_id[s] = _addr(slot.hidden), _addr(slot.token_idx), _addr(slot.expert_id)
            d.weight[s], d.out[s] = _addr(slot.weight), _addr(slot.out)
        d.t_max, d.max_triples = layout.t_max, layout.max_triples
        d.hidden_is_bf16 = int(layout.hidden_dtype == "bfloat16")
        d.store_data, d.expert_stride = store.data_ptr, store.expert_stride
        d.num_layers, d.num_experts = store.num_layers, store.num_experts
        d.hidden_size, d.intermediate = store.shape.hidden, store.shape.intermediate
        self._owner = None
        if split is not None:
            self._owner = np.ascontiguousarray(split.owner, dtype=np.int16)       # kept alive with the desc
            if self._owner.shape != (store.num_layers, store.num_experts):
                raise ValueError(f"owner map {self._owner.shape} does not match the store's "
                                 f"[{store.num_layers}, {store.num_experts}]")
            d.owner = _addr(self._owner)
        d.worker_index, d.isa, d.num_threads = worker_index, isa, num_threads
        if store.expert_format.quantized and quant_format is None:
            raise ValueError(f"the store holds {store.shape.fmt} experts: pass its quant_format "
                             "(cpu_expert_pool.native.quant_desc.quant_format_desc)")
        self._quant = quant_format                                               # kept alive with the desc
        d.quant_format = ctypes.addressof(quant_format) if quant_format is not None else None
        if store.shape.expert_act.bias and act is None:
            raise ValueError(f"the store holds {store.shape.act} experts: pass their act "
                             "(cpu_expert_pool.native.act_desc.expert_act_desc)")
        self._act = act                                                          # kept alive with the desc
        d.act = act_address(act)
        self._desc = d
        self._done = ctypes.c_int64(0)
        self._last_work = ctypes.c_int64(0)
        self._stats = (ctypes.c_int64 * len(STAT_FIELDS))()

    def run(self, deadline_ns: int, hot_ns: int, last_work_ns: int) -> tuple[int, int]:
        """Serve until the deadline (CLOCK_MONOTONIC ns), hot_ns without a request, or a request for Python.
        Returns (SERVE_*, the time of the last answer). The GIL is released meanwhile (ctypes)."""
        self._done.value = self._channel.done
        self._last_work.value = last_work_ns
        rc = self._lib.serve(self._desc, self._done, deadline_ns, hot_ns, self._last_work, self._stats)
        if rc < 0:
            raise RuntimeError(f"ft_serve refused its arguments ({rc})")
        self._channel.done = self._done.value
        return rc, self._last_work.value

    def drain_stats(self, into) -> None:
        """Add the counts since the last drain to `into` (a WorkerStats) and zero them."""
        for i, name in enumerate(STAT_FIELDS):
            if self._stats[i]:
                setattr(into, name, getattr(into, name) + int(self._stats[i]))
                self._stats[i] = 0
