"""Plain-PyTorch reference of one MoE layer's CPU share, written for clarity, not speed.

out[t] = sum over triples k with token t of  weight_k * down_e(silu(gate_e(x_t)) * up_e(x_t)),
with e = expert_k (biased experts: gpt-oss's clamped SwiGLU over the biased gate/up, plus the down bias;
proto/expert_act.py); weights come from the store (bf16 upcast; a quantized expert through
kernels.expert_reference.dequantize_expert), all math in ``dtype`` (float32, or float64 for a tighter bound).
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


def reference_moe_layer(store: ExpertStore, layer: int, hidden: torch.Tensor, token_idx: torch.Tensor,
                        expert_id: torch.Tensor, weight: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """hidden: [T, H]; token_idx, expert_id: [n] int; weight: [n] fp32 -> out: [T, H] fp32."""
    inter = store.shape.intermediate
    out = torch.zeros(hidden.shape, dtype=dtype)
    x = hidden.to(dtype)
    act = store.shape.expert_act
    weights = {e: [v.to(dtype) for v in expert_weights(store, layer, e)] for e in set(expert_id.tolist())}
    for k in range(token_idx.numel()):
        t, e, w = int(token_idx[k]), int(expert_id[k]), float(weight[k])
        w13, w2 = weights[e]                                                # [2I, H], [H, I]
        if act.bias:
            b13, b2 = (b.to(dtype) for b in store.expert_biases(layer, e))  # [2I], [H]
            out[t] += w * F.linear(apply_act(F.linear(x[t], w13, b13), act), w2, b2)
            continue
        gate_up = F.linear(x[t], w13)                                       # [2I]
        h = F.silu(gate_up[:inter]) * gate_up[inter:]                       # [I]
        out[t] += w * F.linear(h, w2)                                       # [H]
    return out.float()
