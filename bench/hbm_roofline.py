"""The HBM roofline of a resident decode step (bench_engine.py): the bytes a step reads from GPU memory over the
measured HBM bandwidth.

Bytes a step: every dense weight (the lm head whole; of the embedding only the batch's rows), the routed experts
it touches (the distinct experts a layer the run's routing sends the batch to, `routed_experts_per_layer`, where
the routing is known ahead (zipf, trace); else its bound, min(E, batch * top_k) a layer), each
request's KV cache up to its context (a sliding layer up to its window), and the linear layers' states (read and
written). Bandwidth: a large device-to-device copy (it reads and writes each byte), median of a few.
"""
from __future__ import annotations

import statistics

import torch

from ftexpert.gpu_worker.checkpoint.config import LINEAR_ATTENTION
from ftexpert.gpu_worker.engine.state_cache import StateCache


def hbm_bandwidth(nbytes: int = 1 << 30, reps: int = 7) -> float:
    """Device-to-device copy bandwidth, bytes/s (bytes read + bytes written over the copy's time), median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[2:])


def routed_experts_per_layer(model, position_steps: list[list[int]]) -> float | None:
    """The mean number of distinct experts a layer routes a decode step, over the steps of `position_steps` (each
    the batch's positions) and every layer, from the model's routing override (None: the model's own router, not
    known ahead)."""
    routing = model.routing_override
    if routing is None or not position_steps:
        return None
    total = 0
    for positions in position_steps:
        pos = torch.tensor(positions, dtype=torch.int64, device=model.device)
        for layer in range(model.cfg.num_layers):
            total += int(routing.ids(layer, pos).unique().numel())
    return total / (len(position_steps) * model.cfg.num_layers)


def step_bytes(model, expert_bytes: int, contexts: list[int],
               experts_per_layer: float | None = None) -> dict[str, int]:
    """Bytes a decode step of len(contexts) requests reads (contexts: each request's tokens in its cache;
    experts_per_layer: the distinct experts a layer routes, None: the bound min(E, batch * top_k))."""
    cfg, dense = model.cfg, model.dense
    batch = len(contexts)
    embed = dense.embed.numel() * dense.embed.element_size()
    row = embed // dense.embed.shape[0]
    tied = dense.embed.data_ptr() == dense.lm_head.data_ptr()
    weights = dense.nbytes - (0 if tied else embed - batch * row)
    per_layer = min(cfg.num_experts, batch * cfg.top_k) if experts_per_layer is None else experts_per_layer
    experts = int(cfg.num_layers * per_layer * expert_bytes)
    kv_token = 2 * cfg.num_kv_heads * cfg.head_dim * dense.embed.element_size()     # K and V, one layer
    params = getattr(model, "params", None)                                         # gpt-oss: sliding windows
    kv = 0
    for i in range(cfg.num_layers):
        if cfg.layer_types and cfg.layer_types[i] == LINEAR_ATTENTION:
            continue
        window = params.layer_window(i) if params is not None else None
        kv += sum(min(c, window or c) for c in contexts) * kv_token
    states = 2 * StateCache.nbytes_for(cfg, batch, dense.embed.dtype)               # read and written
    return {"weights": weights, "experts": experts, "kv": kv, "states": states,
            "total": weights + experts + kv + states, "experts_per_layer": per_layer}


def describe(parts: dict[str, int], bw: float) -> str:
    return (f"HBM roofline: {parts['total'] / 1e9:.2f} GB a step (dense {parts['weights'] / 1e9:.2f}, experts "
            f"{parts['experts'] / 1e9:.2f} ({parts['experts_per_layer']:.1f} a layer), KV {parts['kv'] / 1e9:.3f}, "
            f"states {parts['states'] / 1e9:.3f}) / "
            f"{bw / 1e9:.0f} GB/s (device-to-device copy, median)")
