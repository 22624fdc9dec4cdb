"""Plain torch oracle of `decode_attention` (fp32 math), for lockstep tests and CPU runs.

Same semantics as the Triton kernels: request t's query head h attends to positions p of kv head
h // G (G = Hq / Hkv), for max(0, seq_len - window) <= p < min(seq_len, bucket), position p read from page
block_tables[rows[t], p // PAGE] at p % PAGE; with sinks, head h's softmax has one more logit, sinks[h], whose
probability goes to no position. No host sync (CUDA-graph capturable too), but it gathers the
K/V positions through the table (index_select of whole pages) into a copy: [0, bucket), or, with a sliding window,
only the pages from the one holding the window's first position on (`gather_window`), so a table entry before the
window (-1 where the cache released it) is never read.
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


def gather_window(cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages of each request's last `window` positions: the n = ceil((window - 1) / PAGE) + 1 table entries from
    the one holding position max(0, seq_len - window) on -> (k or v [T, n * PAGE, Hkv, D] (a copy), their positions
    [T, n * PAGE]). Fixed shapes (no host sync); entries before the window are never read; entries past the
    row's end or < 0 (past the sequence) read page 0 and their positions must be masked (>= seq_len)."""
    page = cache.shape[1]
    n = -(-(window - 1) // page) + 1
    first = torch.clamp(seq_lens.long() - window, min=0) // page                                 # [T]
    idx = first[:, None] + torch.arange(n, device=cache.device)[None, :]                         # [T, n]
    table = block_tables.index_select(0, rows.long())                                            # [T, MB]
    pages = table.gather(1, idx.clamp(max=table.shape[1] - 1)).clamp(min=0).long()               # [T, n]
    out = cache.index_select(0, pages.reshape(-1))                                               # [T*n, PAGE, ...]
    positions = (idx[:, :, None] * page + torch.arange(page, device=cache.device)).reshape(len(rows), -1)
    return out.view(len(rows), n * page, *cache.shape[2:]), positions


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               rows: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, bucket: int,
                               sliding_window: int | None = None,
                               block_tables: torch.Tensor | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache, v_cache [NB, PAGE, Hkv, D]; block_tables [B, MB] int (None: a contiguous cache
    [B, S, Hkv, D], row r = page r); rows, seq_lens [T] int; sinks [Hq] (gpt-oss): one more logit per head in
    each softmax's denominator, attending to nothing -> out [T, Hq, D] q.dtype."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    if block_tables is None:
        block_tables = torch.arange(k_cache.shape[0], device=k_cache.device).view(-1, 1)
    lens = seq_lens.long()[:, None]                                          # [T, 1]
    if sliding_window is not None and k_cache.shape[1] < bucket:             # only the window's pages
        keys, pos = gather_window(k_cache, block_tables, rows, seq_lens, sliding_window)   # [T, S, Hkv, D]
        values, _ = gather_window(v_cache, block_tables, rows, seq_lens, sliding_window)
        keys, values = keys.float(), values.float()
        valid = (pos < lens) & (pos < bucket)                                # [T, S]
    else:
        keys = gather_pages(k_cache, block_tables, rows, bucket).float()     # [T, bucket, Hkv, D]
        values = gather_pages(v_cache, block_tables, rows, bucket).float()   # [T, bucket, Hkv, D]
        valid = torch.arange(bucket, device=q.device)[None, :] < lens        # [T, bucket]
        pos = torch.arange(bucket, device=q.device)[None, :]
    qf = q.float().view(T, Hkv, G, D)
    scores = torch.einsum("thgd,tshd->thgs", qf, keys) * scale                # [T, Hkv, G, S]
    if sliding_window is not None:
        valid &= pos >= lens - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:                                                    # the sink's column, then dropped
        sink = sinks.float().view(1, Hkv, G, 1).expand(T, Hkv, G, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)                                # [T, Hkv, G, S]
    out = torch.einsum("thgs,tshd->thgd", probs, values)                     # [T, Hkv, G, D]
    return out.reshape(T, Hq, D).to(q.dtype)
