"""Plain torch references of the quantized-slot kernels (quant_kernels.py): the oracle of their lockstep
tests, and what impl="reference" runs. They decode with the format's own reference codec
(kernels.expert_reference.dequantize_expert) and then do moe_gemv_reference's math with float32 weights.
They read tensor values on the host (the distinct routed rows): not CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels.expert_reference import apply_act, dequantize_expert
from ftexpert.kernels.moe_decode.reference import sum_routes
from ftexpert.proto.expert_format import QuantLayout


def _decoded(rows_u8: torch.Tensor, ids: torch.Tensor, layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """rows ids [n] (>= 0) -> float32 w13 [n, 2I, H], w2 [n, H, I] on rows_u8's device."""
    H, I = layout.hidden_size, layout.intermediate_size
    w13 = torch.empty(len(ids), 2 * I, H, dtype=torch.float32, device=rows_u8.device)
    w2 = torch.empty(len(ids), H, I, dtype=torch.float32, device=rows_u8.device)
    for n, e in enumerate(ids.tolist()):
        gate, up, down = dequantize_expert(rows_u8[e, :layout.expert_nbytes], layout)
        w13[n, :I], w13[n, I:], w2[n] = gate, up, down
    return w13, w2


def dequantize_rows_reference(rows_u8: torch.Tensor, ids: torch.Tensor, layout: QuantLayout,
                              out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot rows ids [n] decoded -> (w13 [n, 2I, H], w2 [n, H, I]) in out_dtype; an id of -1 gives zeros."""
    flat = ids.reshape(-1).long()
    valid = flat >= 0
    w13, w2 = _decoded(rows_u8, torch.where(valid, flat, torch.zeros_like(flat)), layout)
    w13[~valid] = 0.0
    w2[~valid] = 0.0
    return w13.to(out_dtype), w2.to(out_dtype)


def moe_gemv_quant_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows_u8: torch.Tensor,
                             layout: QuantLayout, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                             act=None, partials: bool = False) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * down(silu(gate x[t]) * up x[t]) over the slot rows ids[t,k] of rows_u8 -> [T, H].

    Weights decoded to float32 by the reference codec; rounding as moe_gemv_reference: h = w13 @ x in
    fp32, rounded to x.dtype; silu(gate) in x.dtype; times up in x.dtype; down in fp32 rounded to x.dtype;
    times w in fp32; summed over k in fp32 in k order (0, 1, ...); cast to x.dtype. -1 adds exactly 0.
    b13 [S, 2I] / b2 [S, H]: biases added before gate/up's and down's rounding; act: an ExpertAct (None: silu).
    partials: the weighted per-route outputs [T, K, H] fp32 instead of their sum (reference.sum_routes).
    """
    T, K = ids.shape
    H, inter = x.shape[1], layout.intermediate_size
    if T == 0 or K == 0 or not bool((ids >= 0).any()):
        return torch.zeros(T, K, H, device=x.device) if partials else torch.zeros_like(x)
    flat = ids.reshape(-1).long()                                      # [P], p = t*K + k
    valid = flat >= 0
    used, slot_of = torch.unique(flat[valid], return_inverse=True)     # the distinct routed rows
    w13, w2 = _decoded(rows_u8, used, layout)                          # [U, 2I, H], [U, H, I] fp32
    pick = torch.zeros_like(flat)
    pick[valid] = slot_of
    xp = x.float().unsqueeze(1).expand(T, K, H).reshape(T * K, H, 1)  # [P, H, 1]
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    h = torch.bmm(w13.index_select(0, pick), xp).squeeze(2)                  # [P, 2I] fp32
    if b13 is not None:
        h = h + b13.index_select(0, safe).float()
    h = h.to(x.dtype)                                                        # [P, 2I] x.dtype
    if act is None:
        a = (F.silu(h[:, :inter]) * h[:, inter:]).unsqueeze(2)               # [P, I, 1] x.dtype
    else:
        a = apply_act(h, act).unsqueeze(2)
    y = torch.bmm(w2.index_select(0, pick), a.float()).squeeze(2)            # [P, H] fp32
    if b2 is not None:
        y = y + b2.index_select(0, safe).float()
    y = y.to(x.dtype)                                                        # [P, H] x.dtype
    y = y.float() * weights.reshape(-1, 1).float()                     # [P, H] fp32
    y = torch.where(valid.unsqueeze(1), y, torch.zeros_like(y)).view(T, K, H)
    return y if partials else sum_routes(y, x.dtype)
