"""Prefill attention with gpt-oss's sinks and sliding windows, in bounded memory (attention.PrefillAttention's
custom path; the decode path takes sinks in kernels/decode_attention).

A sink is one more logit per query head, sinks[h], in every softmax's denominator, attending to nothing.

- `sink_attention`: the eager form over the folded layout (logits in memory): the reference, and the path of a
  small call.
- `chunked_sink_attention`: the eager form over slices of the chunk's queries, each against only the keys its
  queries may see (a window layer: the window before the slice), so that no logits tensor exceeds
  CUSTOM_LOGITS_BYTES: at a 4,096-token chunk late in a 128K context the whole [Hq x C, S] fp32 logits of
  gpt-oss-120b (64 heads) would be 137 GB.
- `sink_key_attention`: causal attention with sinks through SDPA's flash kernel, no logits in memory: the sink
  becomes a key. The head dim is padded by SINK_PAD columns; every real key gets zeros there, one extra key at
  position 0 gets (1, 1) in the first two and a zero value, and query head h gets (hi, lo) with hi + lo = sinks[h]
  / scale split into two values of the query dtype (one bf16 would round the sink by up to 2^-9 of it). So q . k
  over the padded dims is the real score for real keys and sinks[h] / scale for the sink key, whose probability
  goes to a zero value: exactly the sink softmax. The lower-right causal mask over S + 1 keys lets every query see
  the sink key. Used for full-attention layers where flash takes the padded shapes (CUDA, fp16 / bf16).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

CUSTOM_LOGITS_BYTES = 512 << 20     # a slice's logits (fp32 and the softmax's copies) at most about this
SINK_PAD = 8                        # the sink's two columns, padded: flash takes head dims in multiples of 8


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Eager attention with optional sinks over the folded layout. q [R, Hkv, M, D], keys / values
    [R, Hkv, S, D], mask: additive float or bool (True: attend), broadcast to [R, Hkv, M, S]; sinks
    [Hkv, M] (each folded query row's head's sink) or None -> [R, Hkv, M, D]."""
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale                          # [R, Hkv, M, S]
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask
    if sinks is not None:
        sink = sinks.to(logits.dtype)[None, :, :, None].expand(logits.shape[0], -1, -1, 1)
        logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def folded_sinks(sinks: torch.Tensor | None, hkv: int, group: int, rows_per_head: int) -> torch.Tensor | None:
    """sinks [Hq] -> [Hkv, G * rows_per_head]: folded row g * rows_per_head + c has head h * G + g's sink."""
    if sinks is None:
        return None
    return sinks.view(hkv, group, 1).expand(hkv, group, rows_per_head).reshape(hkv, group * rows_per_head)


def _slice_len(C: int, heads: int, span_of, budget: int) -> int:
    """The most queries a slice takes (C, or halved until its logits fit `budget`; at least 1): span_of(n) is the
    number of keys a slice of n queries sees."""
    n = C
    while n > 1 and heads * n * span_of(n) * 12 > budget:       # fp32 logits, the sink's copy, the softmax
        n = (n + 1) // 2
    return n


def chunked_sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, start: int, base: int,
                           window: int | None, sinks: torch.Tensor | None, scale: float,
                           budget: int | None = None) -> torch.Tensor:
    """A prefill chunk's causal attention, sliding `window` (None: full) and `sinks`, in slices of queries.

    q [C, Hq, D]: queries at positions start .. start + C - 1; keys / values [1, Hkv, S, D]: positions base ..
    start + C - 1 (S = start + C - base); sinks [Hq] or None -> [C, Hq, D]. Query p attends positions k with
    k <= p (and k > p - window): each slice of queries gets only those keys, so its logits fit `budget` bytes
    (None: CUSTOM_LOGITS_BYTES)."""
    C, Hq, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    end = start + C

    def key_range(c0: int, c1: int) -> tuple[int, int]:           # absolute positions [lo, hi) the slice sees
        lo = base if window is None else max(base, start + c0 - window + 1)
        return lo, start + c1

    def span_of(n: int) -> int:
        return end - base if window is None else min(n + window - 1, end - base)

    n = _slice_len(C, Hq, span_of, CUSTOM_LOGITS_BYTES if budget is None else budget)
    out = torch.empty_like(q)
    for c0 in range(0, C, n):
        c1 = min(C, c0 + n)
        lo, hi = key_range(c0, c1)
        q_pos = torch.arange(start + c0, start + c1, device=q.device)[:, None]      # [m, 1]
        k_pos = torch.arange(lo, hi, device=q.device)[None, :]                      # [1, s]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        m = c1 - c0
        qf = q[c0:c1].reshape(m, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * m, D)   # row g*m + c
        ks, vs = keys[:, :, lo - base:hi - base], values[:, :, lo - base:hi - base]
        o = sink_attention(qf, ks, vs, mask.repeat(G, 1), folded_sinks(sinks, Hkv, G, m), scale)
        out[c0:c1] = o.view(Hkv, G, m, D).permute(2, 0, 1, 3).reshape(m, Hq, D)
    return out


def _sink_padded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [C, Hq, D], keys / values [1, Hkv, S, D], sinks [Hq] -> (q' [1, Hq, C, D + SINK_PAD], k', v'
    [1, Hkv, S + 1, D + SINK_PAD]): the sink as the key at position 0 (see the module docstring)."""
    C, Hq, D = q.shape
    _, Hkv, S, _ = keys.shape
    target = sinks.float() / scale
    hi = target.to(q.dtype)
    lo = (target - hi.float()).to(q.dtype)
    qp = q.new_zeros(1, Hq, C, D + SINK_PAD)
    qp[0, :, :, :D] = q.transpose(0, 1)
    qp[0, :, :, D] = hi[:, None]
    qp[0, :, :, D + 1] = lo[:, None]
    kp = keys.new_zeros(1, Hkv, S + 1, D + SINK_PAD)
    kp[:, :, 1:, :D] = keys
    kp[:, :, 0, D:D + 2] = 1
    vp = values.new_zeros(1, Hkv, S + 1, D + SINK_PAD)
    vp[:, :, 1:, :D] = values
    return qp, kp, vp


def sink_key_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                       scale: float, require_flash: bool = True) -> torch.Tensor | None:
    """Causal (lower-right: the chunk's queries are the last C of the S keys' positions) attention with sinks
    through SDPA: q [C, Hq, D], keys / values [1, Hkv, S, D], sinks [Hq] -> [C, Hq, D]; None where
    `require_flash` and SDPA's flash kernel does not take the padded shapes (the caller takes the eager path)."""
    C, Hq, D = q.shape
    qp, kp, vp = _sink_padded(q, keys, values, sinks, scale)
    if require_flash and not (q.device.type == "cuda"
                              and can_use_flash_attention(SDPAParams(qp, kp, vp, None, 0.0, False, True))):
        return None
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=causal_lower_right(C, kp.shape[2]), scale=scale,
                                         enable_gqa=True)                           # [1, Hq, C, D + SINK_PAD]
    return out[0, :, :, :D].transpose(0, 1).contiguous()
