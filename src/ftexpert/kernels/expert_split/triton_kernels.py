"""The split kernels: `split_pick_kernel` (one program) and the split slot's copy in two parts,
`split_copy_w13_kernel` and `split_copy_w2_kernel` (rows as raw 16-bit words, as kernels/expert_copy)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_pick_kernel(
    routes_ptr, ids_ptr, R,         # [R] int32 routes after ensure (slot or -1), [R] int32 router expert ids
    num_missing_ptr, num_fetched_ptr,   # [1] int32 each: the ensure call's distinct misses M and copies F
    policy_ptr,                     # [POLICY_LEN] int64: the slot cache's device policy
    desc_ptr,                       # [DESC_LEN] int32 out: (expert or -1, limit c)
    counts_ptr,                     # [COUNTS_LEN] int64: splits, GPU channels (added to)
    split_slot, unit, units,        # the split slot; channels per unit; I // unit (0: I is not a multiple)
    POL_MAX_FETCH: tl.constexpr, POL_FRAC: tl.constexpr, POL_ROUND: tl.constexpr, ROUND_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_R)
    m = offs < R
    r = tl.load(routes_ptr + offs, mask=m, other=0)
    e = tl.load(ids_ptr + offs, mask=m, other=-1)
    cpu = m & (r < 0) & (e >= 0)
    first = tl.min(tl.where(cpu, offs, BLOCK_R), axis=0)
    expert = tl.sum(tl.where(offs == first, e, 0), axis=0)
    frac = tl.load(policy_ptr + POL_FRAC)
    phi = frac * tl.load(num_missing_ptr).to(tl.int64) - tl.load(num_fetched_ptr).to(tl.int64) * 65536
    g = tl.minimum((tl.maximum(phi, 0) * units + 32768) >> 16, units - 1)
    active = ((tl.load(policy_ptr + POL_ROUND) == ROUND_SPLIT) & (tl.load(policy_ptr + POL_MAX_FETCH) < 0)
              & (phi > 0) & (first < BLOCK_R) & (units >= 2) & (g > 0))
    tl.store(desc_ptr, tl.where(active, expert, -1).to(tl.int32))
    tl.store(desc_ptr + 1, tl.where(active, (units - g) * unit, 0).to(tl.int32))
    tl.store(routes_ptr + offs, tl.where(active & cpu & (e == expert), split_slot, r), mask=m)
    c0 = tl.load(counts_ptr)
    c1 = tl.load(counts_ptr + 1)
    tl.store(counts_ptr, c0 + active.to(tl.int64))
    tl.store(counts_ptr + 1, c1 + tl.where(active, g * unit, 0).to(tl.int64))


@triton.jit
def split_copy_w13_kernel(
    slots_ptr, host_addr, host_row_words,  # [S_total + 1, W] int16 pool; the layer's host row 0; words per host row
    desc_ptr,                        # [DESC_LEN] int32: (expert or -1, limit c)
    split_slot, row_words,           # the split slot; W (the pool's row stride)
    HW, I,                           # words per w13 row (H * elements' words), intermediate channels
    ROWS: tl.constexpr,              # w13 rows per program (divides the unit: a block lies in one region)
    BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Program p: w13 rows [p*ROWS, (p+1)*ROWS): gate rows and up rows of channels [0, c) are zeroed (so that
    those channels of the split slot add exactly 0: silu(0) * 0 = 0, whatever a stale up row's product with x
    would round to in a narrow dtype), gate rows from c and up rows from I + c are copied. Down columns [0, c)
    stay as they are: they multiply an exact 0 and hold finite values (real expert bytes, or the initial 0)."""
    expert = tl.load(desc_ptr)
    if expert >= 0:
        c = tl.load(desc_ptr + 1)
        r0 = tl.program_id(0) * ROWS
        zero = (r0 < c) | ((r0 >= I) & (r0 < I + c))       # a channel below c (gate or up row); else copied
        host = host_addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:
            host = tl.multiple_of(host, 16)
        slot = expert.to(tl.int64) * 0 + split_slot                # int64 (the pool passes 2**31 words)
        src = host + expert.to(tl.int64) * host_row_words + r0.to(tl.int64) * HW
        dst = slots_ptr + slot * row_words + r0.to(tl.int64) * HW
        for w0 in range(0, ROWS * HW, BLOCK):
            offs = w0 + tl.arange(0, BLOCK)
            mk = offs < ROWS * HW
            if zero:
                v = tl.zeros([BLOCK], dtype=tl.int16)
            else:
                v = tl.load(src + offs, mask=mk)
            tl.store(dst + offs, v, mask=mk)


@triton.jit
def split_copy_w2_kernel(
    slots_ptr, host_addr, host_row_words, desc_ptr, split_slot, row_words,   # as split_copy_w13_kernel
    w2_off,                          # words from an expert's start to its w2
    H, IW,                           # w2 rows, words per w2 row
    PER: tl.constexpr,               # words per element (1: bf16/fp16, 2: fp32)
    UNIT: tl.constexpr,              # channels per unit (a power of two)
    ROWS: tl.constexpr, ALIGNED: tl.constexpr,   # rows per program
    EVEN_ROWS: tl.constexpr,         # H % ROWS == 0
):
    """Program p: columns [c, I) of w2 rows [p*ROWS, (p+1)*ROWS), one unit of columns per step (each row's
    unit is UNIT * PER contiguous words)."""
    expert = tl.load(desc_ptr)
    if expert >= 0:
        c = tl.load(desc_ptr + 1)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rm = rows < H
        host = host_addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:
            host = tl.multiple_of(host, 16)
        slot = expert.to(tl.int64) * 0 + split_slot
        src = host + expert.to(tl.int64) * host_row_words + w2_off + rows[:, None].to(tl.int64) * IW
        dst = slots_ptr + slot * row_words + w2_off + rows[:, None].to(tl.int64) * IW
        cols = tl.arange(0, UNIT * PER)[None, :]
        for u in range(c // UNIT, IW // (UNIT * PER)):
            w0 = u * (UNIT * PER)
            if EVEN_ROWS:           # H a multiple of ROWS: no mask, so the loads stay 16-byte vectors
                v = tl.load(src + w0 + cols)
                tl.store(dst + w0 + cols, v)
            else:
                v = tl.load(src + w0 + cols, mask=rm[:, None])
                tl.store(dst + w0 + cols, v, mask=rm[:, None])
