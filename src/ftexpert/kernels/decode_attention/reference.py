"""Plain torch oracle of `decode_attention` (fp32 math), for lockstep tests and CPU runs.

Same semantics as the Triton kernels: request t's query head h attends to positions p of kv head
h // G (G = Hq / Hkv) in cache row rows[t], for max(0, seq_len - window) <= p < min(seq_len, bucket).
No host sync (CUDA-graph capturable too), but it reads [T, bucket] K/V rows through index_select.
"""
from __future__ import annotations

import torch


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               rows: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, bucket: int,
                               sliding_window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache, v_cache [B, S, Hkv, D]; rows, seq_lens [T] int -> out [T, Hq, D] q.dtype."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    rows = rows.long()
    keys = k_cache[:, :bucket].index_select(0, rows).float()                  # [T, bucket, Hkv, D]
    values = v_cache[:, :bucket].index_select(0, rows).float()                # [T, bucket, Hkv, D]
    qf = q.float().view(T, Hkv, G, D)
    scores = torch.einsum("thgd,tshd->thgs", qf, keys) * scale                # [T, Hkv, G, bucket]
    pos = torch.arange(bucket, device=q.device)[None, :]                     # [1, bucket]
    lens = seq_lens.long()[:, None]                                          # [T, 1]
    valid = pos < lens                                                       # [T, bucket]
    if sliding_window is not None:
        valid &= pos >= lens - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)                                    # [T, Hkv, G, bucket]
    out = torch.einsum("thgs,tshd->thgd", probs, values)                     # [T, Hkv, G, D]
    return out.reshape(T, Hq, D).to(q.dtype)
