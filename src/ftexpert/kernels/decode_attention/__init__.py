"""Flash-decoding attention over the KV cache: one new token per request, split-K over positions.

`decode_attention(q, k_cache, v_cache, rows, seq_lens, scale=, bucket=, sliding_window=, block_tables=)`
reads only the positions each request has (the pages of its block table row, up to its seq_len) in
T * Hkv * NS programs, each a chunk of positions for all G query heads of one kv head, then merges the NS
partial softmaxes. The cache is a pool of pages [NB, PAGE, Hkv, D] (engine/kv_cache.py); a contiguous cache
[B, S, Hkv, D] without tables is read as B pages of S positions.
It replaces SDPA with a [rows, 1, 1, bucket] boolean mask in `DecodeAttention` on CUDA (that ran
cuDNN's flash fprop at ~32 us per layer for a 1,280-token context on the H200). A Triton kernel
(triton_kernels.py) with a plain torch reference beside it (reference.py), dispatched by api.py.
"""
from ftexpert.kernels.decode_attention.api import (DEFAULT_BLOCKS, DecodeAttentionBlocks, decode_attention,
                                                   split_plan)
from ftexpert.kernels.decode_attention.reference import decode_attention_reference, gather_pages, gather_window

__all__ = ["decode_attention", "decode_attention_reference", "gather_pages", "gather_window", "DecodeAttentionBlocks",
           "DEFAULT_BLOCKS", "split_plan"]
