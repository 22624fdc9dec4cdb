"""The plan-copy kernel. Grid (copies, chunks): program (i, c) copies chunk c of words [col_lo, col_hi)
of plan entry i when i < num_indices (the whole row, or a part of it such as an expert's w13 or w2).
Rows move as raw 16-bit words, so any 2- or 4-byte weight dtype copies exactly."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_plan_kernel(
    slots_ptr,            # [S_total, W] int16: the GPU slot pool as raw words
    host_addr,            # int: address of the layer's host row 0 (mapped for the device)
    host_row_words,       # W_stride: words between host rows (store rows may be padded)
    evict_ptr,            # [S] int32 plan: destination slots
    src_ptr,              # [S] int32 plan: host rows
    num_indices_ptr,      # [1] int32 plan length
    row_words,            # W: words per expert (the slot pool's row stride)
    chunk_words,          # words each program copies
    col_lo,               # first word of each row to copy
    col_hi,               # one past the last word to copy (<= W)
    BLOCK: tl.constexpr,  # words per load/store
    ALIGNED: tl.constexpr = False,   # host_addr 16-byte aligned (and rows a multiple of 8 words apart)
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    if i < tl.load(num_indices_ptr):
        dst_row = tl.load(evict_ptr + i).to(tl.int64)
        src_row = tl.load(src_ptr + i).to(tl.int64)
        host = host_addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:
            # 16-byte aligned rows (the store's are page-aligned): say so, or the int -> pointer cast loses
            # the alignment and every thread reads 2-byte words (64-byte PCIe reads per warp, not vectors).
            host = tl.multiple_of(host, 16)
        start = col_lo + c * chunk_words
        end = tl.minimum(start + chunk_words, col_hi)
        for w0 in range(start, end, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            m = offs < end
            v = tl.load(host + src_row * host_row_words + offs, mask=m)
            tl.store(slots_ptr + dst_row * row_words + offs, v, mask=m)
