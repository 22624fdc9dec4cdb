"""Plain-PyTorch reference of one MoE layer's CPU share, written for clarity, not speed.

out[t] = sum over triples k with token t of  weight_k * down_e(silu(gate_e(x_t)) * up_e(x_t)),
with e = expert_k (biased experts: gpt-oss's clamped SwiGLU over the biased gate/up, plus the down bias;
proto/expert_act.py); weights come from the store (bf16 upcast; a quantized expert through
kernels.expert_reference.dequantize_expert), all math in ``dtype`` (float32, or float64 for a tighter bound).
``act_int8=True`` is the compiled kernel's int8-activation path (native/quant_int8.h) in plain maths: x and h go
through ``quantize_activations_int8`` (blocks of 16, int8, one fp32 scale a block) before their matrices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels.expert_reference import apply_act, dequantize_expert
from ftexpert.proto.expert_store import ExpertStore


def expert_weights(store: ExpertStore, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) float32 of one expert, in any format (quantized: the reference dequantization)."""
    if store.expert_format.quantized:
        gate, up, down = dequantize_expert(store.expert_bytes_view(layer, expert), store.shape.quant_layout)
        return torch.cat((gate, up)), down
    w13, w2 = store.expert_views(layer, expert)
    return w13.float(), w2.float()


INT8_BLOCK = 16       # quant_int8.h Q8_BLOCK


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 16) -> (q [..., K] int8-valued float32, scale [..., K / 16] float32), as
    quant_int8.h's q8_quantize_row: per block of 16 consecutive values amax = max |x|, q = round(x * (127 / amax))
    (ties to even; 0 where amax is 0), scale = amax / 127; x is about q * scale (repeated over the block)."""
    blocks = x.float().unflatten(-1, (-1, INT8_BLOCK))                  # [..., K / 16, 16]
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)   # a true fp32 division (127.0 / t
    #                                                      would take a reciprocal, then multiply)
    q = torch.round(blocks * inv).clamp(-127, 127)
    return q.flatten(-2), (amax / 127.0).squeeze(-1)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the int8 path sees it: q * scale (float32)."""
    q, scale = quantize_activations_int8(x)
    return (q.unflatten(-1, (-1, INT8_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)


def reference_moe_layer(store: ExpertStore, layer: int, hidden: torch.Tensor, token_idx: torch.Tensor,
                        expert_id: torch.Tensor, weight: torch.Tensor,
                        dtype: torch.dtype = torch.float32, act_int8: bool = False) -> torch.Tensor:
    """hidden: [T, H]; token_idx, expert_id: [n] int; weight: [n] fp32 -> out: [T, H] fp32."""
    inter = store.shape.intermediate
    out = torch.zeros(hidden.shape, dtype=dtype)
    x = (int8_activations(hidden) if act_int8 else hidden.float()).to(dtype)
    quant_h = (lambda h: int8_activations(h.float()).to(dtype)) if act_int8 else (lambda h: h)
    act = store.shape.expert_act
    weights = {e: [v.to(dtype) for v in expert_weights(store, layer, e)] for e in set(expert_id.tolist())}
    for k in range(token_idx.numel()):
        t, e, w = int(token_idx[k]), int(expert_id[k]), float(weight[k])
        w13, w2 = weights[e]                                                # [2I, H], [H, I]
        if act.bias:
            b13, b2 = (b.to(dtype) for b in store.expert_biases(layer, e))  # [2I], [H]
            out[t] += w * F.linear(quant_h(apply_act(F.linear(x[t], w13, b13), act)), w2, b2)
            continue
        gate_up = F.linear(x[t], w13)                                       # [2I]
        h = F.silu(gate_up[:inter]) * gate_up[inter:]                       # [I]
        out[t] += w * F.linear(quant_h(h), w2)                              # [H]
    return out.float()
