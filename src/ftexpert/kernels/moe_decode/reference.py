"""Plain torch references of the decode kernels: the oracle of the lockstep tests, and the CPU path.

Each reference rounds where the torch code of the model rounds (gpu_worker/models/layers.py,
and the gathered-experts reference of tests/kernels/test_moe_decode.py); the Triton kernels round at the same
points, so the two differ only in the order of fp32 summation inside a dot product or a norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels.expert_reference import apply_act


def moe_gemv_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                       act=None, partials: bool = False) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * down(silu(gate x[t]) * up x[t]) over the experts ids[t,k] -> [T, H] x.dtype.

    x [T, H]; ids [T, K] int32|int64 rows of w13 [S, 2I, H] and w2 [S, H, I], -1: the pair adds
    exactly 0 (its weight is not read, may be anything); weights [T, K] (fp32).
    Rounding, as gathered_expert_ffn: h = w13[id] @ x in x.dtype; silu(gate) in x.dtype; times up
    in x.dtype; down in x.dtype; times w in fp32; summed over k in fp32 in k order; cast to x.dtype.
    b13 [S, 2I] / b2 [S, H] (both or neither): biases added to gate/up and down before their rounding; act: a
    proto.expert_act.ExpertAct (None: silu), applied by kernels.expert_reference.apply_act.
    partials: the weighted per-route outputs [T, K, H] fp32 instead of their sum (`sum_routes` of them is the sum).
    """
    T, K = ids.shape
    H, inter = x.shape[1], w2.shape[2]
    flat = ids.reshape(-1).long()                                      # [P], p = t*K + k
    valid = flat >= 0
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    xp = x.unsqueeze(1).expand(T, K, H).reshape(T * K, H, 1)           # [P, H, 1]
    if b13 is None:
        h = torch.bmm(w13.index_select(0, safe), xp).squeeze(2)        # [P, 2I] x.dtype
    else:
        h = torch.baddbmm(b13.index_select(0, safe).unsqueeze(2), w13.index_select(0, safe), xp).squeeze(2)
    if act is None:
        a = (F.silu(h[:, :inter]) * h[:, inter:]).unsqueeze(2)         # [P, I, 1] x.dtype
    else:
        a = apply_act(h, act).unsqueeze(2)
    if b2 is None:
        y = torch.bmm(w2.index_select(0, safe), a).squeeze(2)          # [P, H] x.dtype
    else:
        y = torch.baddbmm(b2.index_select(0, safe).unsqueeze(2), w2.index_select(0, safe), a).squeeze(2)
    y = y.float() * weights.reshape(-1, 1).float()                     # [P, H] fp32
    y = torch.where(valid.unsqueeze(1), y, torch.zeros_like(y)).view(T, K, H)
    return y if partials else sum_routes(y, x.dtype)


def sum_routes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weighted per-route outputs y [T, K, H] fp32 (K >= 1) -> their sum over k in fp32 in k order (0, 1, ...),
    cast to dtype: [T, H] (moe_sum_k_kernel's order; next_decode's add_rms_norm sums its partials so)."""
    acc = y[:, 0]
    for k in range(1, y.shape[1]):                                     # fixed order: k = 0, 1, ...
        acc = acc + y[:, k]
    return acc.to(dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N]: fp32 statistics, x_normed cast to x.dtype, times weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta in x.dtype, rms_norm of that) -- the residual add and the next layer's norm. delta [T, K, N] fp32
    with x [T, N]: the routed experts' per-route outputs, summed first (sum_routes)."""
    if delta.dim() == x.dim() + 1:
        delta = sum_routes(delta, x.dtype)
    x_new = x + delta
    return x_new, rms_norm_reference(x_new, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D] (x.dtype) -> x * cos + rotate_half(x) * sin."""
    return x * cos + _rotate_half(x) * sin


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor | None,
                           k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D]; per-head RMSNorm with [D] weights (None: none), then rope."""
    T, D = q.shape[0], q.shape[-1]
    cos, sin = cos.reshape(T, 1, D), sin.reshape(T, 1, D)
    if q_norm is not None:
        q = rms_norm_reference(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm_reference(k, k_norm, eps)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def route_topk_reference(logits: torch.Tensor, top_k: int, softmax_first: bool = True,
                         renorm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids [T, K] int64, weights [T, K] fp32), as layers.route after its GEMM.

    softmax_first (qwen3 / olmoe): softmax over E in fp32, top-k, renormalise when ``renorm``;
    else (mixtral): top-k of the fp32 logits, softmax over those k.
    """
    if not softmax_first:
        top_logits, ids = torch.topk(logits.float(), top_k, dim=-1)
        return ids, torch.softmax(top_logits, dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights
