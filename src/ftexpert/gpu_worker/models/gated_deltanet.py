"""One Gated DeltaNet layer of Qwen3-Next (``linear_attn``): projections, the short causal conv1d over the
sequence with its carried state, the gated delta rule (kernels/gated_delta) with its recurrent state, RMSNormGated
and the output projection.

The forward's T tokens are B = ``states.num_seqs`` sequences of L = T / B consecutive tokens (a prefill chunk:
B = 1; a decode step: L = 1). A chunk of one token runs the recurrence; longer ones the chunked form. With
``kernel_impl`` (the model's fused forward) a decode step whose states give their rows in place
(``states.conv_rows``, ``states.recurrent_rows``) runs kernels/next_decode: one launch for the conv update, splits
and gates, one for the gated delta rule on the recurrent state rows in place (no gather and scatter of the 2 MiB
rows at Qwen3-Next's shapes), one for RMSNormGated; otherwise the torch code below (the kernels' reference) runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels import gated_delta
from ftexpert.kernels import next_decode as kn
from ftexpert.kernels.next_decode.reference import causal_conv, decay_gates, gated_rms_norm, split_qkvz

from ftexpert.gpu_worker.checkpoint.config import MoeConfig


def gated_deltanet(cfg: MoeConfig, w, h: torch.Tensor, states, layer: int, impl: str = "auto",
                   linear=F.linear, kernel_impl: str | None = None) -> torch.Tensor:
    """h [T, H] (normed) -> [T, H]; reads and writes linear layer ``layer``'s state rows in ``states``. ``impl``:
    kernels/gated_delta's impl for the torch code (prefill chunks; decode without kernel_impl); ``linear``: the dense
    projection (the model's: F.linear or a decode GEMV); ``kernel_impl``: the next_decode kernels' impl for a decode
    step, the gated delta rule's included (None: the torch code)."""
    lin = cfg.linear_attention
    T = h.shape[0]
    Hk, Hv, Dk, Dv = lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim
    r = Hv // Hk
    B = states.num_seqs
    if T % B:
        raise ValueError(f"{T} tokens do not split into {B} sequences of equal length")
    L = T // B
    if w.in_proj_all is not None:                               # fused (fuse_next_projections): one GEMM, views
        qkvz, ba = linear(h, w.in_proj_all).split([w.in_proj_qkvz.shape[0], w.in_proj_ba.shape[0]], dim=1)
    else:
        qkvz, ba = linear(h, w.in_proj_qkvz), linear(h, w.in_proj_ba)
    conv_rows = states.conv_rows(layer) if kernel_impl is not None and L == 1 else None
    if conv_rows is not None:
        return _decode_fused(cfg, w, qkvz, ba, states, layer, conv_rows, linear, kernel_impl)
    q, k, v, z, b, a = split_qkvz(qkvz, ba, Hk, Dk, r, Dv)
    mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)   # [T, C]
    conv_state, rec_state = states.read(layer)
    mixed, conv_state = causal_conv(mixed.view(B, L, -1), conv_state, w.conv1d)
    q, k, v = mixed.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
    q, k, v = q.reshape(B, L, Hk, Dk), k.reshape(B, L, Hk, Dk), v.reshape(B, L, Hv, Dv)
    g, beta = decay_gates(b.reshape(B, L, Hv), a.reshape(B, L, Hv), w.A_log, w.dt_bias)   # [B, L, Hv] each
    rule = gated_delta.recurrent_gated_delta_rule if L == 1 else gated_delta.chunk_gated_delta_rule
    o, rec_state = rule(q, k, v, g, beta, rec_state, impl=impl)                   # [B, L, Hv, Dv]
    states.write(layer, conv_state, rec_state)
    o = gated_rms_norm(o.reshape(T, Hv, Dv), z.reshape(T, Hv, Dv), w.linear_norm, cfg.rms_norm_eps)
    return linear(o.reshape(T, Hv * Dv), w.out_proj)                            # [T, H]


def _decode_fused(cfg: MoeConfig, w, qkvz: torch.Tensor, ba: torch.Tensor, states, layer: int,
                  conv_rows: tuple[torch.Tensor, torch.Tensor], linear, kernel_impl: str) -> torch.Tensor:
    """A decode step (L = 1) through kernels/next_decode: the conv state rows updated in place by the first kernel,
    the recurrent state rows by the gated delta rule's (gdn_decode_rule: with kernel_impl "reference" its torch
    reference, a gather, kernels/gated_delta's reference rule and a scatter, whatever the model's delta impl)."""
    lin = cfg.linear_attention
    T = qkvz.shape[0]
    heads = kn.DeltaNetHeads(lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)
    r = heads.Hv // heads.Hk
    q, k, v, g, beta = kn.gdn_decode_pre(qkvz, ba, *conv_rows, w.conv1d, w.A_log, w.dt_bias, heads, impl=kernel_impl)
    o = kn.gdn_decode_rule(q.squeeze(1), k.squeeze(1), v.squeeze(1), g.squeeze(1), beta.squeeze(1),
                           *states.recurrent_rows(layer), impl=kernel_impl)              # [T, Hv, Dv]
    z = split_qkvz(qkvz, ba, heads.Hk, heads.Dk, r, heads.Dv)[3].unflatten(-1, (r, heads.Dv))   # [T, Hk, r, Dv]
    o = kn.gated_rms_norm(o, z, w.linear_norm, cfg.rms_norm_eps, impl=kernel_impl)
    return linear(o.view(T, heads.Hv * heads.Dv), w.out_proj)                    # [T, H]
