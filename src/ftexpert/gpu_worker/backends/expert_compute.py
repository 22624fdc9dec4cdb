"""The expert FFN over bf16 (model dtype) weights w13 [E, 2I, H] / w2 [E, H, I], in its two modes, and the rule
that picks one (`pick_mode`), shared by every backend: `ResidentExperts` (resident.py) and the offload and hybrid
backends, and the expert math's bf16 rows (expert_math.py), so that greedy tokens agree across backends.

    x:            [T, H]  hidden states after the post-attention norm (model dtype)
    topk_ids:     [T, K]  int64 expert ids in 0..E-1
    topk_weights: [T, K]  float32 routing weights
    returns       [T, H]  sum_k w_k * down(silu(gate x) * up x), model dtype

Two ways to compute, same result up to fp32 summation order:
- ``grouped``: sort the (token, expert) pairs by expert and run the GEMMs per expert group: two
  `torch._grouped_mm` launches over all experts where they apply (CUDA bf16, Hopper+), else one GEMM pair per
  routed expert with one host sync per layer (the per-expert counts). Reads each routed expert once. For prefill,
  and for decode batches above gather_max_pairs: up to GROUPED_MM_MAX_GROUPS experts (a resident layer) the
  `_grouped_mm` path makes no host sync and has fixed shapes, so it is captured in the decode graphs too
  (`grouped_capturable`).
- ``gemv``: `kernels.moe_decode.moe_gemv`, Triton GEMVs that read the T*K routed experts in place
  (no copy). No host sync, fixed shapes (CUDA-graph capturable); for small decode batches. On CPU
  it runs its torch reference.
``auto`` takes ``gemv`` on CUDA when T*K <= gather_max_pairs (the backend's: resident 128, offload / hybrid 32), else
``grouped``. Forcing ``gemv`` applies to prefill too, where a long prompt would read T*K experts: meant for
tests. The offload and hybrid backends choose with the same rule (`pick_mode`, `expert_ffn`), so that
greedy tokens agree across backends.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels.moe_decode import moe_gemv

MODES = ("auto", "grouped", "gemv")
GRAPH_SAFE_MODES = ("gemv",)       # no host sync, fixed shapes, whatever the weights (grouped: grouped_capturable)
# Groups one torch._grouped_mm call takes (its check is group_count < 1024: "Can't process more than 1024 groups"); a larger
# slot pool (offload / hybrid at 25% of qwen3-30b-a3b's experts: 1,536 slots) goes in windows of this many.
GROUPED_MM_MAX_GROUPS = 1023


def grouped_mm_applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands on their device: a CUDA bf16 call on Hopper or later,
    with 16-byte aligned rows (its kernels' requirements), in a torch that has it."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return False
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return False
    if getattr(torch.version, "hip", None) or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    sizes = (x.shape[1], w13.shape[1], w2.shape[2], w13.stride(0), w2.stride(0), w13.stride(1), w2.stride(1))
    aligned = all(v % 8 == 0 for v in sizes) and all(t.data_ptr() % 16 == 0 for t in (x, w13, w2))
    return aligned and w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1


def group_ends(sorted_ids: torch.Tensor, groups: int) -> torch.Tensor:
    """[groups] int32: entry g = how many of ``sorted_ids`` (ascending, in 0..groups-1) are <= g, the end row of
    group g. A search on the device: no host sync (torch.bincount syncs to size its output)."""
    bounds = torch.arange(groups, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)


def grouped_capturable(w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the grouped mode over these weights, for activations of ``dtype``, is the sync-free
    `grouped_mm_expert_ffn` (both GEMMs' group offsets stay on the device; at most GROUPED_MM_MAX_GROUPS groups,
    one call each): then a decode forward in the grouped mode can be captured in a CUDA graph (torch._grouped_mm
    on Hopper or later takes its offsets on the device; torch's fallback below Hopper syncs, and is not taken)."""
    if w13.shape[0] > GROUPED_MM_MAX_GROUPS or w13.device.type != "cuda":
        return False
    probe = torch.empty(0, w13.shape[2], dtype=dtype, device=w13.device)   # a fresh activation's alignment
    return grouped_mm_applies(probe, w13, w2)


def grouped_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The grouped mode: `grouped_mm_expert_ffn` where the operands allow (`grouped_mm_applies`), else
    `grouped_loop_expert_ffn` (same rounding points; the GEMMs' fp32 accumulation order differs).

    x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    if grouped_mm_applies(x, w13, w2):
        return grouped_mm_expert_ffn(x, topk_ids, topk_weights, w13, w2)
    return grouped_loop_expert_ffn(x, topk_ids, topk_weights, w13, w2)


def grouped_mm_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The grouped FFN as two torch._grouped_mm launches over all E experts (or slots; experts without a
    route are empty groups): no per-expert launches, and no host sync up to GROUPED_MM_MAX_GROUPS groups (a
    larger pool goes in windows of that many groups, after one sync for where their rows start). A prefill chunk routes to nearly every
    expert of a layer, so the per-expert loop costs E GEMM pairs of launches and a sync a layer (~0.4 s a
    1K-token chunk of qwen3-30b-a3b on the H200; the time to first token with these grouped GEMMs is in
    docs/BENCHMARKS.md, "Prefill: time to first token").

    Rounds where the loop does: gate/up and down results in x.dtype, silu * up in x.dtype, the weighted sum
    over k in fp32 in k order. x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    T, K = topk_ids.shape
    groups = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)                                   # [P = T*K]
    sorted_ids, order = torch.sort(flat_ids, stable=True)             # pairs grouped by expert
    offs = group_ends(sorted_ids, groups)                             # [E] int32
    x_sorted = x.index_select(0, order // K)                          # [P, H]
    if groups <= GROUPED_MM_MAX_GROUPS:
        y_sorted = _grouped_ffn_rows(x_sorted, w13, w2, offs)        # [P, H] x.dtype
    else:          # a slot pool of more groups than one call takes: windows of them, cut where their rows start
        y_sorted = torch.empty_like(x_sorted)
        cuts = list(range(0, groups, GROUPED_MM_MAX_GROUPS)) + [groups]
        starts = [0] + offs[[c - 1 for c in cuts[1:]]].tolist()        # host sync: the windows' row bounds
        for g0, g1, r0, r1 in zip(cuts, cuts[1:], starts, starts[1:]):
            if r1 > r0:
                y_sorted[r0:r1] = _grouped_ffn_rows(x_sorted[r0:r1], w13[g0:g1], w2[g0:g1], offs[g0:g1] - r0)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)    # back to (token, k) order
    return (y.view(T, K, -1).float() * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def _grouped_ffn_rows(x_sorted: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) of rows grouped by expert: x_sorted [R, H], group g = rows [offs[g-1], offs[g])
    (offs [G] int32 ends, the first group from row 0), w13 [G, 2I, H], w2 [G, H, I] -> [R, H] x.dtype."""
    inter = w2.shape[2]
    h = torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offs)   # [R, 2I]
    h = F.silu(h[:, :inter]) * h[:, inter:]                           # [R, I]
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)        # [R, H]


def grouped_loop_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference-quality MoE FFN, one GEMM pair per routed expert (host sync for the counts).

    x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    T, K = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)                                   # [P = T*K]
    order = torch.argsort(flat_ids, stable=True)                      # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync
    x_sorted = x.index_select(0, order // K)                          # [P, H]
    y_sorted = torch.empty(T * K, x.shape[1], dtype=torch.float32, device=x.device)  # [P, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        h = F.linear(x_sorted[start:start + count], w13[expert])      # [C, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]                       # [C, I]
        y_sorted[start:start + count] = F.linear(h, w2[expert])       # [C, H]
        start += count
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)    # back to (token, k) order
    # Weighted sum over k in a fixed order: deterministic, no atomics.
    return (y.view(T, K, -1) * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def gemv_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """The same FFN reading the routed experts in place (kernels.moe_decode.moe_gemv): no copy, no
    host sync, fixed shapes. A route at -1 adds exactly 0.

    x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    return moe_gemv(x, topk_ids, topk_weights, w13, w2, impl=impl)


def pick_mode(mode: str, on_cuda: bool, num_pairs: int, gather_max_pairs: int) -> str:
    """The compute mode for a call of ``num_pairs`` (token, expert) pairs: ``mode`` unless "auto";
    auto: ``gemv`` on CUDA for at most ``gather_max_pairs`` pairs, else ``grouped``."""
    if mode != "auto":
        return mode
    return "gemv" if on_cuda and num_pairs <= gather_max_pairs else "grouped"


def expert_ffn(mode: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               w13: torch.Tensor, w2: torch.Tensor, kernel_impl: str = "auto") -> torch.Tensor:
    """Run the FFN of a resolved ``mode`` (grouped | gemv); see the module docstring."""
    if mode == "gemv":
        return gemv_expert_ffn(x, topk_ids, topk_weights, w13, w2, impl=kernel_impl)
    return grouped_expert_ffn(x, topk_ids, topk_weights, w13, w2)
