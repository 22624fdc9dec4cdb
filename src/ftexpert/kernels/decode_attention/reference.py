"""Plain torch oracle of `decode_attention` (fp32 math), for lockstep tests and CPU runs.

Same semantics as the Triton kernels: request t's query head h attends to positions p of kv head
h // G (G = Hq / Hkv), for max(0, seq_len - window) <= p < min(seq_len, bucket), position p read from page
block_tables[rows[t], p // PAGE] at p % PAGE. No host sync (CUDA-graph capturable too), but it gathers the
[T, bucket] K/V positions through the table (index_select of whole pages) into a copy.
"""
from __future__ import annotations

import torch


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor, span: int) -> torch.Tensor:
    """Positions [0, span) of each request through its table row: cache [NB, PAGE, Hkv, D], block_tables [B, MB],
    rows [T] -> [T, span, Hkv, D] (a copy). Entries < 0 (unused) read page 0: their positions must be masked."""
    T, page = rows.shape[0], cache.shape[1]
    n = -(-span // page)
    pages = block_tables.index_select(0, rows.long())[:, :n].clamp(min=0).long()      # [T, n]
    out = cache[:, :min(page, span)].index_select(0, pages.reshape(-1))               # [T*n, <=PAGE, Hkv, D]
    return out.view(T, -1, *cache.shape[2:])[:, :span]


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               rows: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, bucket: int,
                               sliding_window: int | None = None,
                               block_tables: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache, v_cache [NB, PAGE, Hkv, D]; block_tables [B, MB] int (None: a contiguous cache
    [B, S, Hkv, D], row r = page r); rows, seq_lens [T] int -> out [T, Hq, D] q.dtype."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    if block_tables is None:
        block_tables = torch.arange(k_cache.shape[0], device=k_cache.device).view(-1, 1)
    keys = gather_pages(k_cache, block_tables, rows, bucket).float()         # [T, bucket, Hkv, D]
    values = gather_pages(v_cache, block_tables, rows, bucket).float()       # [T, bucket, Hkv, D]
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
