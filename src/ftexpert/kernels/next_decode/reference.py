"""Plain torch references of the Qwen3-Next / gpt-oss decode kernels, and the model code they replace.

The functions the models' plain forwards call live here (models/qwen3_next.py, gated_deltanet.py and
gpt_oss_layers.py import them), so the oracle of the lockstep tests is that code itself. Each rounds where
transformers' modules round; the Triton kernels (triton_kernels.py) round at the same points.
Shapes: T tokens, H hidden, Hk / Hv key / value heads of a Gated DeltaNet layer (r = Hv / Hk), Dk / Dv their
head dims, C = 2 * Hk * Dk + Hv * Dv conv channels, K the conv kernel size, D an attention head dim, R its
rotary part.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels.gated_delta.reference import recurrent_gated_delta_rule
from ftexpert.kernels.moe_decode.reference import sum_routes


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """(offset + w) * x / rms(x), all in fp32, cast back to x's dtype: Qwen3-Next's RMSNorm (offset 1) and
    gpt-oss's (offset 0: the weight applied in fp32)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() if offset == 0 else offset + weight.float()
    return (x32 * w).to(x.dtype)


def shared_combine(routed: torch.Tensor, shared: torch.Tensor, h: torch.Tensor,
                   gate_weight: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's MoE output: routed + sigmoid(h . gate_weight) * shared (gate_weight [1, H]), in x's dtype."""
    return routed + torch.sigmoid(F.linear(h, gate_weight)) * shared


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0,
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, offset_rms_norm of it); with ``shared`` = (shared expert
    output, h, gate weight [1, H]), delta is the routed output and the add takes shared_combine(delta, ...). A delta
    of [T, K, H] fp32 is the routed experts' weighted per-route outputs, summed first (moe_decode's sum_routes)."""
    if delta.dim() == 3:
        delta = sum_routes(delta, x.dtype)
    if shared is not None:
        delta = shared_combine(delta, *shared)
    x = x + delta
    return x, offset_rms_norm(x, weight, eps, offset)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The shared expert's activation: silu(gate) * up in their dtype."""
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------------------------

def split_qkvz(qkvz: torch.Tensor, ba: torch.Tensor, Hk: int, Dk: int, r: int, Dv: int):
    """The projections (rows grouped per key head: [q Dk | k Dk | v r*Dv | z r*Dv] and [b r | a r]) -> views
    q, k [T, Hk, Dk], v, z [T, Hk, r*Dv], b, a [T, Hk, r]."""
    T = qkvz.shape[0]
    q, k, v, z = qkvz.view(T, Hk, 2 * Dk + 2 * r * Dv).split([Dk, Dk, r * Dv, r * Dv], -1)
    b, a = ba.view(T, Hk, 2 * r).split([r, r], -1)
    return q, k, v, z, b, a


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU. x [B, L, C], state [B, C, K-1] (the sequence's last K-1 inputs before x),
    weight [C, K] -> (out [B, L, C], new state [B, C, K-1])."""
    full = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)              # [B, C, K-1+L]
    out = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])             # [B, C, L]
    return F.silu(out).transpose(1, 2), full[:, :, -(weight.shape[1] - 1):]


def decay_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [..., Hv] -> (g = -exp(A_log) * softplus(a + dt_bias) fp32, beta = sigmoid(b) in b's dtype)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def gdn_decode_pre(qkvz: torch.Tensor, ba: torch.Tensor, conv_cache: torch.Tensor, rows: torch.Tensor,
                   conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, Hk: int, Hv: int,
                   Dk: int, Dv: int):
    """A decode step (one token a sequence, T = B) between the projections and the gated delta rule: the conv
    over the rows ``rows`` [B] of ``conv_cache`` [N, C, K-1] (updated in place), q / k expanded to the value
    heads -> q, k [B, 1, Hv, Dk], v [B, 1, Hv, Dv], g [B, 1, Hv] fp32, beta [B, 1, Hv]."""
    T, r = qkvz.shape[0], Hv // Hk
    q, k, v, _, b, a = split_qkvz(qkvz, ba, Hk, Dk, r, Dv)
    mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)      # [T, C]
    out, state = causal_conv(mixed.view(T, 1, -1), conv_cache.index_select(0, rows), conv_weight)
    conv_cache.index_copy_(0, rows, state.to(conv_cache.dtype))
    q, k, v = out.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q = q.reshape(T, 1, Hk, Dk).repeat_interleave(r, dim=2)
    k = k.reshape(T, 1, Hk, Dk).repeat_interleave(r, dim=2)
    g, beta = decay_gates(b.reshape(T, 1, Hv), a.reshape(T, 1, Hv), A_log, dt_bias)
    return q, k, v.reshape(T, 1, Hv, Dv), g, beta


def gdn_decode_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The gated delta rule's decode step (one token a sequence) on the rows ``rows`` [T] of ``state``
    [N, Hv, Dk, Dv] fp32 as the layer ran it before the in-place kernel: gather the rows, the rule's reference
    (kernels/gated_delta, which L2-normalises q / k and scales q), scatter the new state. q, k [T, Hqk, Dk],
    v [T, Hv, Dv], g, beta [T, Hv] -> o [T, Hv, Dv] in v's dtype."""
    o, new = recurrent_gated_delta_rule(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1),
                                        beta.unsqueeze(1), state.index_select(0, rows))
    state.index_copy_(0, rows, new)
    return o.squeeze(1)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNormGated: w * norm(x) (cast to x's dtype first) * silu(gate), over the last axis."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * x32.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Gated attention
# ---------------------------------------------------------------------------------------------------------------

def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, R] -> rotary on the first R channels, the rest unchanged."""
    R = cos.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    half = R // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def qk_norm_partial_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D]: the per-head (1 + w) norm, then the rotary embedding on the first R channels
    (cos / sin [T, 1, R] in q's dtype)."""
    q = apply_partial_rope(offset_rms_norm(q, q_norm, eps), cos, sin)
    k = apply_partial_rope(offset_rms_norm(k, k_norm, eps), cos, sin)
    return q, k


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output gate: out [T, Hq, D] * sigmoid(gate [T, Hq, D]) -> [T, Hq * D]."""
    T = out.shape[0]
    return out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
