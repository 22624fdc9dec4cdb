"""Launchers of the device hand-off kernels: validation, then one launch each."""
from __future__ import annotations

import torch
import triton

from ftexpert.kernels.impl import interpreted

COUNT_MAX_PAIRS = 256      # count_call: routes of one call it counts (a decode step's T*K; compares n x n);
                           # HybridExperts' device path takes calls up to this size only
RING_BLOCK_R = 64          # routes compacted per step of the ring's loop (decode: T*K <= 64 -> one step)
RING_BLOCK_H = 1024
JOIN_BLOCK = 1024          # elements of the partial sums per join program (T=1, H=2048: 2 programs)
RING_WARPS = 4
JOIN_WARPS = 4


def _check_device(*tensors: torch.Tensor) -> bool:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"hand-off tensors must share one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not interpreted():
        raise ValueError("the device hand-off runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)")
    return dev.type == "cuda"


def ring(x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor, weights: torch.Tensor, *,
         owner: torch.Tensor | None, owner_off: int, member: int, addrs: dict[str, int], fail: torch.Tensor,
         state: torch.Tensor, slot: int, layer: int, hidden_bf16: bool, always_ring: bool = False,
         split: torch.Tensor | None = None, split_slot: int = -1) -> None:
    """Hand the routes at -1 whose expert `member` owns (all of them when owner is None) to a CPU worker.

    x [T, H] (rows contiguous); ids, routes [T, K] int (router ids, slot ids after ensure); weights [T, K];
    addrs: device addresses of the slot's hidden/token_idx/expert_id/weight buffers, its request line
    ("line") and the channel's "request_seq"; fail [1] int32 and state [STATE_WORDS] int64 on the device.
    always_ring: ring even when no route is left to this member (benchmarks of the bare round trip).
    split: [2] int32 on the device (kernels/expert_split's desc: expert or -1, limit c): the routes at
    `split_slot` go to the CPU too and the request line carries the split; None: a line without a split."""
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.handoff.triton_kernels import ring_kernel
    T, H = x.shape
    if x.stride(1) != 1 or not (ids.is_contiguous() and routes.is_contiguous() and weights.is_contiguous()):
        raise ValueError("ring: x needs contiguous rows and ids/routes/weights must be contiguous")
    if ids.shape != routes.shape or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"ring: ids {tuple(ids.shape)}, routes {tuple(routes.shape)}, weights "
                         f"{tuple(weights.shape)} must all be [T={T}, K]")
    on_gpu = _check_device(x, ids, routes, weights, fail, state, *(() if split is None else (split,)))
    if split is not None and (split.dtype != torch.int32 or split.numel() < 2 or split_slot < 0):
        raise ValueError(f"ring: split must be int32 [2] and split_slot >= 0, got {split.dtype} "
                         f"{tuple(split.shape)} and {split_slot}")
    R, K = ids.numel(), ids.shape[1]
    ring_kernel[(1,)](x, x.stride(0), T, H, ids, routes, weights, R, K,
                      owner if owner is not None else state, owner_off, member,
                      addrs["hidden"], addrs["token_idx"], addrs["expert_id"], addrs["weight"],
                      addrs["line"], addrs["request_seq"], fail, state, slot, layer,
                      split if split is not None else fail, max(split_slot, 0),
                      HIDDEN_BF16=hidden_bf16, ALWAYS_RING=always_ring, USE_OWNER=owner is not None, BLOCK_R=RING_BLOCK_R,
                      BLOCK_H=RING_BLOCK_H, ON_GPU=on_gpu, HAS_SPLIT=split is not None, num_warps=RING_WARPS)


def join(src: torch.Tensor, dst: torch.Tensor, *, addrs: dict[str, int], fail: torch.Tensor,
         state: torch.Tensor, slot: int) -> None:
    """dst [T, H] = src + the worker's partial sums of the call rung into `slot` (after waiting for them,
    at most state[ST_DEADLINE_NS]), or dst = src when nothing was rung or the call failed (then
    fail[0] = 1 and the host word holds a failure code). A rung call adds its wait to state[ST_WAIT_NS].

    addrs: device addresses of the slot's "out", its request "line", the channel's "done_seq", the
    doorbell's "abort" and "host_fail" words."""
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.handoff.triton_kernels import join_kernel
    if src.shape != dst.shape or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"join: src {tuple(src.shape)} and dst {tuple(dst.shape)} must be contiguous and alike")
    on_gpu = _check_device(src, dst, fail, state)
    numel = src.numel()
    grid = (max(1, -(-numel // JOIN_BLOCK)),)
    join_kernel[grid](src, dst, numel, addrs["out"], addrs["line"], addrs["done_seq"], addrs["abort"],
                      fail, addrs["host_fail"], state, slot,
                      SAME=src.data_ptr() == dst.data_ptr(), BLOCK=JOIN_BLOCK, ON_GPU=on_gpu,
                      num_warps=JOIN_WARPS)


def count_call(counts: torch.Tensor, ids: torch.Tensor, num_indices: torch.Tensor, num_missing: torch.Tensor, *,
               offload: bool) -> None:
    """counts (int64 [COUNTERS], device) += one ensure call's figures, without a host sync: the plan's
    length, distinct misses, one call (one offload call when `offload`), routed pairs, distinct hits.
    ids: the call's router expert ids (any shape, at most COUNT_MAX_PAIRS); num_indices,
    num_missing: the slot cache's plan-length and num_missing_full words."""
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.handoff.triton_kernels import COUNTERS, count_call_kernel
    n = ids.numel()
    if counts.dtype != torch.int64 or counts.numel() != COUNTERS:
        raise ValueError(f"count_call: counts must be int64 [{COUNTERS}], got {counts.dtype} {tuple(counts.shape)}")
    if not 0 < n <= COUNT_MAX_PAIRS:
        raise ValueError(f"count_call: ids must have 1..{COUNT_MAX_PAIRS} entries, got {tuple(ids.shape)}")
    ids = ids.contiguous()
    _check_device(counts, ids, num_indices, num_missing)
    count_call_kernel[(1,)](counts, ids, n, num_indices, num_missing, OFFLOAD=offload,
                            BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
