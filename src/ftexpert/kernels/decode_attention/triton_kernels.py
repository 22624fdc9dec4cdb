"""Flash-decoding: split-K attention of one new token per request over its paged KV cache.

The cache is a pool of pages (KV blocks) of PAGE positions each, [NB, PAGE, Hkv, D] per layer; request t reads
the pages its block table row names, ``tables[rows[t]]``: position p lives at position p % PAGE of page
``tables[rows[t], p // PAGE]``. A contiguous cache [B, S, Hkv, D] is the case PAGE = S, tables = [[0], [1], ...].

Two kernels, launched back to back (api.py):

1. `decode_attn_split_kernel`, grid (T, Hkv, NUM_SPLITS). Program (t, h, s) takes the G = Hq / Hkv
   query heads of request t that share kv head h, a [G, D] tile, and the s-th chunk of positions
   [s * chunk, (s + 1) * chunk) of request t, clipped to the valid positions
   [max(0, seq_len - window), min(seq_len, bucket)). It walks the chunk BLOCK_N positions at a time
   (each position's page read from the block table row, so a tile may span several pages)
   with an online softmax (fp32) and writes its partial (max m, sum l, unnormalised acc [G, D]).
   A tile's K and V are loaded together; how it finds their rows is below (page addressing).
   A program whose clipped chunk is empty (beyond seq_len, or before the window) writes nothing and
   ends at once, so the fixed grid of a CUDA graph costs little for short contexts.
2. `decode_attn_merge_kernel`, grid (T, Hq): out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
   over the non-empty splits only (the same clipping, from seq_len), M = max_s m_s. With HAS_SINKS (gpt-oss)
   head h's sink logit joins the denominator: M = max(max_s m_s, sink), denominator + exp(sink - M).

Scores: ``USE_DOT`` multiplies the [GP, D] query tile (G rows padded with zeros to GP >= 16, as
tl.dot needs) by the [BLOCK_N, D] key tile on tensor cores, and p [GP, BLOCK_N] (rounded to the
cache dtype, as flash attention does) by the [BLOCK_N, D] value tile; otherwise (small G) a
broadcast product and tl.sum, in fp32. fp32 inputs take tl.dot's "ieee" precision (no TF32).

Page addressing: a tile's page ids, one a position, are read one tile ahead (the first tile's before the query) and
carried through the loop, so the table read is not a dependent load right in front of each tile's K. Three other
ways (ids read in the loop from its index alone; one id a page, broadcast; the table row read beside seq_len) were
measured against it on an H100 (bench_decode_attention.py's page-addressing sweep, T = 1, num_stages 1-5, 2026-12-07):
each was slower at every num_stages, 7.5-10.0 against 7.1 us at a 1K context and 11.0-13.7 against 10.4 at 4K, and
they were removed (docs/BENCHMARKS.md).

Every block the loop loads holds at least one valid position (the loop starts at the first valid
position of the chunk, not at a BLOCK_N boundary), so the running max is finite after the first
block and no exp ever sees -inf - (-inf).

Legend: T requests, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, NB pages of PAGE positions,
B block table rows of MB entries, NS splits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.pdl import pdl_enter


@triton.jit
def decode_attn_split_kernel(
    q_ptr,                # [T, Hq, D] (last dim contiguous)
    k_ptr, v_ptr,         # [NB, PAGE, Hkv, D] cache views of one layer (last dim contiguous)
    tables_ptr,           # [B, MB] int: each block table row's pages (entries past a request's length unread)
    rows_ptr,             # [T] int: block table row of each request
    seq_lens_ptr,         # [T] int: valid positions of each request
    m_ptr, l_ptr,         # [T, Hq, NS] fp32 partial max / sum
    acc_ptr,              # [T, Hq, NS, D] fp32 partial unnormalised output
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,            # the block table's row stride
    scale,                # fp32 softmax scale
    bucket,               # positions >= bucket are never read
    window,               # sliding window (used when HAS_WINDOW)
    chunk,                # positions per split
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,      # query heads per kv head
    GP: tl.constexpr,     # G padded (power of two; >= 16 with USE_DOT)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two (>= 16 with USE_DOT)
    BLOCK_N: tl.constexpr,  # positions per loop step
    HAS_WINDOW: tl.constexpr,
    USE_DOT: tl.constexpr,
    IS_FP32: tl.constexpr,
    PAGE: tl.constexpr,   # positions per page
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + t).to(tl.int64)
    lo = s.to(tl.int64) * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, seq_len), bucket)
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    if lo < hi:
        row = tl.load(rows_ptr + t).to(tl.int64)
        table = tables_ptr + row * stride_tb
        # the first tile's pages, before the query: a page read is a dependent load ahead of every K / V load
        offs_n = lo + tl.arange(0, BLOCK_N)
        page_next = tl.load(table + offs_n // PAGE, mask=offs_n < hi, other=0).to(tl.int64)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        g_ok = offs_g < G
        heads = kh * G + offs_g                                               # [GP] query heads
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)            # [GP, BLOCK_D]
        if not USE_DOT:
            q = q.to(tl.float32)
        k_base = k_ptr + kh * stride_kh
        v_base = v_ptr + kh * stride_vh
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)                               # [BLOCK_N] positions
            n_ok = offs_n < hi
            kv_mask = n_ok[:, None] & d_ok[None, :]
            page = page_next                                                  # [BLOCK_N]
            in_page = offs_n % PAGE
            k = tl.load(k_base + (page * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :],
                        mask=kv_mask, other=0.0)                              # [BLOCK_N, BLOCK_D]
            v = tl.load(v_base + (page * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :],
                        mask=kv_mask, other=0.0)                              # [BLOCK_N, BLOCK_D]
            # the next tile's pages, read while this tile computes
            offs_next = offs_n + BLOCK_N
            page_next = tl.load(table + offs_next // PAGE, mask=offs_next < hi, other=0).to(tl.int64)
            if USE_DOT:
                if IS_FP32:
                    qk = tl.dot(q, tl.trans(k), input_precision="ieee")       # [GP, BLOCK_N]
                else:
                    qk = tl.dot(q, tl.trans(k))
            else:
                qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            qk = tl.where(n_ok[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))                       # finite: >= 1 valid
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])                                   # [GP, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                if IS_FP32:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv                                   # [GP, BLOCK_D]
            m_i = m_new
        part = (t.to(tl.int64) * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + s   # [GP]
        tl.store(m_ptr + part, m_i, mask=g_ok)
        tl.store(l_ptr + part, l_i, mask=g_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def decode_attn_merge_kernel(
    m_ptr, l_ptr,         # [T, Hq, NS] fp32 partials
    acc_ptr,              # [T, Hq, NS, D] fp32
    seq_lens_ptr,         # [T] int
    out_ptr,              # [T, Hq, D] (contiguous), the query dtype
    sinks_ptr,            # [Hq] the heads' sink logits (read when HAS_SINKS)
    bucket, window, chunk,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + t).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lo = offs_s.to(tl.int64) * chunk                                          # the split kernel's
    hi = tl.minimum(tl.minimum(lo + chunk, seq_len), bucket)                  # clipping, per split
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    s_ok = (lo < hi) & (offs_s < NUM_SPLITS)                                  # the splits that wrote
    base = (t.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
    m = tl.load(m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))       # [SPLITS_P2]
    l = tl.load(l_ptr + base + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)              # [SPLITS_P2, BLOCK_D]
    m_max = tl.max(m, axis=0)                                                 # finite: seq_len >= 1
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.where(s_ok, tl.exp(m - m_max), 0.0)                                # [SPLITS_P2]
    denom = tl.sum(w * l, axis=0)
    if HAS_SINKS:
        denom += tl.exp(sink - m_max)
    out = tl.sum(w[:, None] * acc, axis=0) / denom                            # [BLOCK_D]
    tl.store(out_ptr + (t.to(tl.int64) * tl.num_programs(1) + h) * HEAD_DIM + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
