"""`decode_attention`: validation, the split plan, and dispatch to the Triton kernels or the reference.

`impl="auto"` runs the Triton kernels on CUDA tensors and the torch reference elsewhere; `"triton"`
on CPU tensors needs TRITON_INTERPRET=1 set before the kernels are first defined (the Triton
interpreter; tests/conftest.py sets it); `"reference"` always runs the torch code.

Nothing here syncs with the host or reads a tensor value on the host: for fixed shapes and a fixed
`bucket` the launches are identical, so a call is CUDA-graph capturable and a replay reads the
current `rows` / `seq_lens` (scratch and output are allocated per call, inside the graph's pool).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.kernels.impl import IMPLS, resolve_impl as _resolve_impl  # noqa: F401 (IMPLS: this package's choices)
from ftexpert.kernels.pdl import pdl_args

from ftexpert.kernels.decode_attention.reference import decode_attention_reference

DOT_MIN_GROUP = 4      # tl.dot for G >= this many query heads per kv head, a broadcast-sum below

@dataclass(frozen=True)
class DecodeAttentionBlocks:
    """Launch shape of the split kernel. Results depend on these only through the order of fp32
    summation. Defaults are a first guess for the H200 (not yet tuned on the GPU:
    `python bench/bench_decode_attention.py --sweep` times alternatives).

    The bucket is cut into NS chunks: NS = the largest power of two <= target_programs / (T * Hkv),
    at most max_splits, with chunks of at least min_chunk positions (short_min_chunk for a bucket of at most
    short_bucket positions); a chunk is a multiple of block_n. qwen3-30b-a3b (Hkv=4) at T=1: bucket 512 -> 8
    splits of 64, bucket 2,048 -> 16 splits of 128 positions (64 programs), bucket 32,768 -> 64 splits of 512
    (256 programs); at T=4, 16 splits. Short buckets take one tile a program: on the H100 (the --sweep of
    bench_decode_attention.py, T=1, 320 positions in a 512 bucket) 8 splits of 64 took 5.4 us against 6.6 us
    for 4 of 128; from 2,048 positions 128-position chunks were as fast or faster.

    num_stages: the split kernel's software pipelining depth, a launch option (None: Triton's default, 3 on
    NVIDIA). On an H100 (`bench_decode_attention.py --sweep-set stages`, T = 1, 2026-12-07, as the rows of the
    then page-addressing sweep) the default was the
    fastest: 7.10 us at a 1K context against 7.3-8.0 at 1, 2, 4; 10.40 at 4K against 10.45-11.73.
    """
    block_n: int = 64
    min_chunk: int = 128
    short_min_chunk: int = 64
    short_bucket: int = 512
    target_programs: int = 256
    max_splits: int = 64
    num_warps: int = 4
    merge_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self):
        if self.num_stages is not None and (type(self.num_stages) is not int or self.num_stages < 1):
            raise ValueError(f"num_stages={self.num_stages!r}: must be None (Triton's default) or an int >= 1")


DEFAULT_BLOCKS = DecodeAttentionBlocks()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def split_plan(bucket: int, num_requests: int, num_kv_heads: int,
               blocks: DecodeAttentionBlocks = DEFAULT_BLOCKS) -> tuple[int, int]:
    """(num_splits, chunk) for a bucket: host ints, a function of the shapes only (fixed per graph).
    num_splits * chunk >= bucket, chunk a multiple of block_n, and no split starts at or past bucket."""
    if bucket < 1:
        raise ValueError(f"bucket={bucket} must be >= 1")
    want = _prev_pow2(max(1, blocks.target_programs // max(1, num_requests * num_kv_heads)))
    min_chunk = blocks.short_min_chunk if bucket <= blocks.short_bucket else blocks.min_chunk
    splits = max(1, min(want, blocks.max_splits, -(-bucket // max(1, min_chunk))))
    chunk = -(-bucket // splits)
    chunk = -(-chunk // blocks.block_n) * blocks.block_n
    return -(-bucket // chunk), chunk


def _check(q, k_cache, v_cache, rows, seq_lens, bucket, sliding_window, block_tables) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [T, Hq, D] and the caches [NB, PAGE, Hkv, D], got {tuple(q.shape)} and "
                         f"{tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
    T, Hq, D = q.shape
    NB, page, Hkv, Dk = k_cache.shape
    if Dk != D or Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head dims must "
                         f"match and Hq must be a multiple of Hkv")
    if rows.shape != (T,) or seq_lens.shape != (T,):
        raise ValueError(f"rows {tuple(rows.shape)} and seq_lens {tuple(seq_lens.shape)} must be [T={T}]")
    if rows.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"rows and seq_lens must be int32 or int64, got {rows.dtype}, {seq_lens.dtype}")
    span = page
    if block_tables is not None:
        if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"block_tables must be an int32 or int64 [B, MB] tensor, got {block_tables.dtype} "
                            f"{tuple(block_tables.shape)}")
        span = page * block_tables.shape[1]
    tensors = (q, k_cache, v_cache, rows, seq_lens) + (() if block_tables is None else (block_tables,))
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not 1 <= bucket <= span:
        raise ValueError(f"bucket={bucket} must be in [1, {span}] (the positions a block table row spans: "
                         f"{span // page} pages of {page})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")


def contiguous_tables(k_cache: torch.Tensor) -> torch.Tensor:
    """The block tables of a contiguous cache [B, S, Hkv, D] seen as B pages of S positions: [[0], [1], ...]."""
    return torch.arange(k_cache.shape[0], dtype=torch.int32, device=k_cache.device).view(-1, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, *, scale: float, bucket: int, sliding_window: int | None = None,
                     impl: str = "auto", blocks: DecodeAttentionBlocks | None = None,
                     block_tables: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per request over its paged KV cache -> out [T, Hq, D] in q.dtype.

    q: [T, Hq, D] (rope'd; the last dim contiguous); k_cache, v_cache: [NB, PAGE, Hkv, D] one layer's
    pool of pages (any strides but the last dim contiguous); block_tables: [B, MB] int, the pages of each
    table row in position order (position p in page block_tables[r, p // PAGE], at p % PAGE; entries at or
    past a request's seq_len are never read, so -1 may mark them); None: a contiguous cache [B, S, Hkv, D],
    row r = page r. rows: [T] int, the table row of each request; seq_lens: [T] int, device, valid positions
    of each request (position + 1, counting the token just written), in [1, bucket]; bucket: host int <=
    MB * PAGE, >= max(seq_lens): bounds the grid and the positions read (fixed per CUDA graph). Request t's
    query head h attends to positions p of kv head h // (Hq / Hkv) with max(0, seq_len - sliding_window) <= p
    < seq_len; softmax in fp32 with `scale`; sinks: [Hq] float (gpt-oss's attention sinks), head h's softmax
    takes one more logit, sinks[h], that attends to nothing. rows, seq_lens and the table entries are not checked
    against the shapes (that would need a host sync).
    """
    _check(q, k_cache, v_cache, rows, seq_lens, bucket, sliding_window, block_tables)
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device
                              or not sinks.dtype.is_floating_point):
        raise ValueError(f"sinks must be a float [Hq={q.shape[1]}] tensor on {q.device}, got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    if block_tables is None:
        block_tables = contiguous_tables(k_cache)
    impl = _resolve_impl(impl, q.device)
    if impl == "reference":
        return decode_attention_reference(q, k_cache, v_cache, rows, seq_lens, scale=scale, bucket=bucket,
                                          sliding_window=sliding_window, block_tables=block_tables,
                                          sinks=sinks)
    blocks = blocks or DEFAULT_BLOCKS
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head-dim) axis")
    use_dot = G >= DOT_MIN_GROUP
    block_d = max(16 if use_dot else 1, _next_pow2(D))
    gp = max(16, _next_pow2(G)) if use_dot else _next_pow2(G)
    block_n = blocks.block_n
    if use_dot and block_n < 16:
        raise ValueError(f"block_n={block_n} must be >= 16 with tl.dot")
    num_splits, chunk = split_plan(bucket, T, Hkv, blocks)
    m = torch.empty(T, Hq, num_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(T, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    window = int(sliding_window) if sliding_window is not None else 0
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.decode_attention.triton_kernels import decode_attn_merge_kernel, decode_attn_split_kernel
    pdl = pdl_args(q.device)
    page = k_cache.shape[1]
    opts = {} if blocks.num_stages is None else {"num_stages": blocks.num_stages}
    decode_attn_split_kernel[(T, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, rows, seq_lens, m, l, acc,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        float(scale), bucket, window, chunk,
        NUM_SPLITS=num_splits, G=G, GP=gp, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, USE_DOT=use_dot, IS_FP32=q.dtype == torch.float32,
        PAGE=page, num_warps=blocks.num_warps, **opts, **pdl)
    decode_attn_merge_kernel[(T, Hq)](
        m, l, acc, seq_lens, out, m if sinks is None else sinks.contiguous(), bucket, window, chunk,
        NUM_SPLITS=num_splits, SPLITS_P2=_next_pow2(num_splits), HEAD_DIM=D, BLOCK_D=_next_pow2(D),
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, num_warps=blocks.merge_warps, **pdl)
    return out
