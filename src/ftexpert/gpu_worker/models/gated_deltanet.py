"""One Gated DeltaNet layer of Qwen3-Next (``linear_attn``): projections, the short causal conv1d over the
sequence with its carried state, the gated delta rule (kernels/gated_delta) with its recurrent state, RMSNormGated
and the output projection.

The forward's T tokens are B = ``states.num_seqs`` sequences of L = T / B consecutive tokens (a prefill chunk:
B = 1; a decode step: L = 1). A chunk of one token runs the recurrence; longer ones the chunked form.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels import gated_delta

from ftexpert.gpu_worker.checkpoint.config import MoeConfig


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU. x [B, L, C], state [B, C, K-1] (the sequence's last K-1 inputs before x),
    weight [C, K] -> (out [B, L, C], new state [B, C, K-1])."""
    full = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)              # [B, C, K-1+L]
    out = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])             # [B, C, L]
    return F.silu(out).transpose(1, 2), full[:, :, -(weight.shape[1] - 1):]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNormGated: w * norm(x) (cast to x's dtype first) * silu(gate), over the last axis."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * x32.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


def gated_deltanet(cfg: MoeConfig, w, h: torch.Tensor, states, layer: int, impl: str = "auto",
                   linear=F.linear) -> torch.Tensor:
    """h [T, H] (normed) -> [T, H]; reads and writes linear layer ``layer``'s state rows in ``states``. ``linear``:
    the dense projection (the model's: F.linear or a decode GEMV)."""
    lin = cfg.linear_attention
    T = h.shape[0]
    Hk, Hv, Dk, Dv = lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim
    r = Hv // Hk
    B = states.num_seqs
    if T % B:
        raise ValueError(f"{T} tokens do not split into {B} sequences of equal length")
    L = T // B
    # in_proj_qkvz rows are grouped per key head: [q Dk | k Dk | v r*Dv | z r*Dv]; in_proj_ba: [b r | a r]
    q, k, v, z = linear(h, w.in_proj_qkvz).view(T, Hk, 2 * Dk + 2 * r * Dv).split([Dk, Dk, r * Dv, r * Dv], -1)
    b, a = linear(h, w.in_proj_ba).view(T, Hk, 2 * r).split([r, r], -1)
    mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)   # [T, C]
    conv_state, rec_state = states.read(layer)
    mixed, conv_state = causal_conv(mixed.view(B, L, -1), conv_state, w.conv1d)
    q, k, v = mixed.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
    q, k, v = q.reshape(B, L, Hk, Dk), k.reshape(B, L, Hk, Dk), v.reshape(B, L, Hv, Dv)
    beta = b.reshape(B, L, Hv).sigmoid()
    g = -w.A_log.float().exp() * F.softplus(a.reshape(B, L, Hv).float() + w.dt_bias.float())   # [B, L, Hv]
    rule = gated_delta.recurrent_gated_delta_rule if L == 1 else gated_delta.chunk_gated_delta_rule
    o, rec_state = rule(q, k, v, g, beta, rec_state, impl=impl)                   # [B, L, Hv, Dv]
    states.write(layer, conv_state, rec_state)
    o = gated_rms_norm(o.reshape(T, Hv, Dv), z.reshape(T, Hv, Dv), w.linear_norm, cfg.rms_norm_eps)
    return linear(o.reshape(T, Hv * Dv), w.out_proj)                            # [T, H]
