"""Prefill attention of a short chunk late in a long context (a prefix-cache hit's turn), in two parts merged by their
log-sum-exp, so that the work spreads over the GPU.

SDPA's flash kernel gives a chunk of C queries ceil(C / 128) x Hq thread blocks, each walking every key: at a 516-token
turn on a 33K history (qwen3-30b-a3b: Hq 32) that is 160 blocks on 132 SMs, two waves for 1.2 waves of work, and an
H100 measured 183 TFLOP/s against 353 for a 4K chunk on the same keys (docs/BENCHMARKS.md, "Paged KV cache"). Here:

  history  every query attends every key of [0, start) (no mask), the G = Hq / Hkv query heads of a kv head folded
           into the query axis ([1, Hkv, G * C, D] against [1, Hkv, start, D]): ceil(G C / 128) x Hkv blocks (516
           queries: 33 x 4 = 132), each kv head's keys read by its own G heads' rows;
  chunk    the chunk's queries against its own C keys, causal (square: the upper-left and lower-right alignments
           agree), the kv heads repeated to the Hq heads (C keys, a small copy);
  merge    out = w o_history + (1 - w) o_chunk, w = sigmoid(lse_history - lse_chunk) per query and head (fp32), the
           softmax over all keys written as its two parts' softmaxes weighted by their shares of the sum.

Each part's output and log-sum-exp come from `attention_lse`: on CUDA the flash kernel's own op, which returns both
(`torch.ops.aten._scaled_dot_product_flash_attention`), elsewhere a plain matmul / logsumexp / softmax (the
reference the tests compare with). `split_applies` says where the split pays: on CUDA, a chunk whose plain flash grid
is under two waves of the SMs, after a history of at least SPLIT_MIN_HISTORY positions and four times the chunk.
"""
from __future__ import annotations

import torch

SPLIT_MIN_HISTORY = 2048       # positions before the chunk below which the plain flash call is kept
FLASH_BLOCK_M = 128            # the flash kernel's query rows a thread block (head dim 128, bf16 / fp16)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the plain path and the merge compute in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def split_applies(num_queries: int, num_heads: int, start: int, device: torch.device) -> bool:
    """Whether `prefix_split_attention` should replace the plain flash call for a chunk of `num_queries` queries of
    `num_heads` heads at positions start..: CUDA, a long history, and a plain grid under two waves."""
    if device.type != "cuda" or start < max(SPLIT_MIN_HISTORY, 4 * num_queries):
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return -(-num_queries // FLASH_BLOCK_M) * num_heads < 2 * sms


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, M, D], k / v [1, H, N, D] (the last dim contiguous) -> (out [1, H, M, D] in q's dtype, lse
    [1, H, M] fp32, fp64 for fp64 inputs: log sum_n exp(scale q.k_n) over the keys each query sees). causal: query m
    sees keys n <= m (M == N)."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse[..., :q.shape[2]].float()
    acc = _acc_dtype(q)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale                    # [1, H, M, N]
    if causal:
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.to(acc))
    return out.to(q.dtype), lse


def prefix_split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                           scale: float) -> torch.Tensor:
    """q [C, Hq, D] of positions start..start+C-1; keys / values [1, Hkv, start + C, D], the context (history, then
    the chunk's own keys) -> [C, Hq, D]: each query attends causally over [0, its position] (module docstring)."""
    C, Hq, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    if start < 1 or keys.shape[2] != start + C:
        raise ValueError(f"the context holds {keys.shape[2]} positions: it must be the history ({start} >= 1) and "
                         f"the chunk's {C}")
    qf = q.view(C, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * C, D)             # row g*C + c
    o_hist, lse_hist = attention_lse(qf, keys[:, :, :start], values[:, :, :start], causal=False, scale=scale)
    o_hist = o_hist.view(Hkv, G, C, D).permute(2, 0, 1, 3).reshape(C, Hq, D)
    lse_hist = lse_hist.view(Hkv, G, C).permute(2, 0, 1).reshape(C, Hq)
    qh = q.transpose(0, 1).unsqueeze(0)                                                   # [1, Hq, C, D]
    k_own = keys[:, :, start:].repeat_interleave(G, dim=1)                                # [1, Hq, C, D]
    v_own = values[:, :, start:].repeat_interleave(G, dim=1)
    o_own, lse_own = attention_lse(qh, k_own, v_own, causal=True, scale=scale)
    o_own, lse_own = o_own[0].transpose(0, 1), lse_own[0].transpose(0, 1)               # [C, Hq, D], [C, Hq]
    acc = _acc_dtype(q)
    w = torch.sigmoid((lse_hist - lse_own).to(acc))[..., None]                           # [C, Hq, 1]
    return (w * o_hist.to(acc) + (1.0 - w) * o_own.to(acc)).to(q.dtype)
