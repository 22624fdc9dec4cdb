"""Triton kernels of `linear_gemv`; `reference.py` holds the plain torch oracle.

Only plain features: tl.load / tl.store with masks, tl.sum, tl.where, tl.minimum, scalar `if`,
`range` and `tl.static_range` loops (GLU: moe_decode's silu and rounding helpers). No tl.dot (T <= 16
rows of x against a weight tile is an elementwise product and a row sum per token, accumulated in
fp32), no atomics.

Legend: T tokens (rows of x), T_PAD the power of two >= T, N output features (rows of w), K input
features.

Layout: a program loads a [BLOCK_N, BLOCK_K] weight tile with 16-byte vectors along K (Triton's
coalescing gives [1, 8] bf16 per thread, 32 lanes along K, then the warps along K as long as
BLOCK_K >= 256 * num_warps for bf16, 128 * num_warps for fp32). x is loaded per token as a
[1, BLOCK_K] row, which then gets the same layout as the tile's columns: no layout conversion, each
thread reads only its own columns of x (from L1 / L2: x is small and shared by every program). With
a smaller BLOCK_K the warps fall along N and x's row has fewer elements than threads x 8: its
vectors are narrower than the tile's, and Triton converts it through shared memory every step
(correct, slower; compile_check --resources shows it as `loop cvt 1`).
Per step and token, tl.sum reduces the products over K: in-thread, 5 shuffle levels over the lanes,
and across the warps through shared memory (two barriers).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.moe_decode.triton_kernels import _rnd, _silu
from ftexpert.kernels.pdl import pdl_enter


@triton.jit
def _load_w_tile(w_rows, kk, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns kk, in fp32 (columns past K read 0)."""
    if EVEN_K:
        wv = tl.load(w_rows + kk).to(tl.float32)
    else:
        wv = tl.load(w_rows + kk, mask=kk < K, other=0.0).to(tl.float32)
    return wv


@triton.jit
def _x_row(x_row, kk, K, EVEN_K: tl.constexpr):
    """A token's x at columns kk [1, BLOCK_K], in x's dtype (columns past K read 0)."""
    if EVEN_K:
        xv = tl.load(x_row + kk)
    else:
        xv = tl.load(x_row + kk, mask=kk < K, other=0.0)
    return xv


@triton.jit
def _gemv_step(acc, wv, x_row0, kk, K, T, stride_xt, toks,
               T_PAD: tl.constexpr, EVEN_K: tl.constexpr,
               u_row0=None, stride_ut=0, GLU: tl.constexpr = False, ACCURATE: tl.constexpr = False,
               EMU_BF16: tl.constexpr = False):
    """acc[:, t] += the row sums of wv * x[t, kk] for every token t < T (fp32). GLU: the input is
    DT(DT(silu(x[t])) * u[t]) (next_decode's silu_mul, its roundings), made here from the gate x and the up u."""
    for t in tl.static_range(T_PAD):
        if t < T:
            xv = _x_row(x_row0 + t * stride_xt, kk, K, EVEN_K)                  # [1, BLOCK_K]
            if GLU:
                DT = xv.dtype
                act = _rnd(_silu(xv.to(tl.float32), ACCURATE), DT, EMU_BF16).to(tl.float32)
                uv = _x_row(u_row0 + t * stride_ut, kk, K, EVEN_K).to(tl.float32)
                xv = _rnd(uv * act, DT, EMU_BF16)
            xv = xv.to(tl.float32)
            part = tl.sum(wv * xv, axis=1)                                    # [BLOCK_N]
            acc = tl.where(toks[None, :] == t, acc + part[:, None], acc)
    return acc


@triton.jit
def linear_gemv_kernel(
    x_ptr,                # [T, K] x.dtype, row stride stride_xt, columns contiguous
    w_ptr,                # [N, K] x.dtype, row stride stride_wn, columns contiguous
    out_ptr,              # [T, N] contiguous, x.dtype: y
    T, N, K,              # K > 0
    stride_xt, stride_wn,
    BLOCK_N: tl.constexpr,    # output rows per program (a power of two)
    BLOCK_K: tl.constexpr,    # columns per loop step (a power of two)
    T_PAD: tl.constexpr,      # power of two >= T: the accumulator's width
    EVEN_K: tl.constexpr,     # K % BLOCK_K == 0: no column masks
    USE_PDL: tl.constexpr = False,   # launched with PDL (kernels/pdl.py): the first weight tile is
                                     # loaded before the wait for the kernel before this one
    b_ptr=None,               # BIAS: [N] x.dtype, added in fp32 before the one rounding
    BIAS: tl.constexpr = False,
    u_ptr=None, stride_ut=0,  # GLU: up [T, K] x.dtype (row stride stride_ut); x is the gate
    GLU: tl.constexpr = False,
    ACCURATE: tl.constexpr = False,   # GLU's silu: libdevice exp and IEEE division (a GPU, not the interpreter)
    EMU_BF16: tl.constexpr = False,   # GLU's roundings to bfloat16 by hand (the interpreter)
):
    """Grid (cdiv(N, BLOCK_N),). Program j: out[t, n] for every token t < T and n in [j*BLOCK_N, (j+1)*BLOCK_N)
    (+ b[n] with BIAS, in fp32 before the rounding). GLU: the input row of token t is DT(DT(silu(x[t])) * u[t]),
    computed per loop step for the step's columns (every program recomputes it: a few exps a column against the
    launch of a separate activation kernel).

    Each weight tile is loaded once and multiplied with the x row of every token (x.dtype -> fp32,
    products and sums in fp32); tl.sum reduces a token's [BLOCK_N, BLOCK_K] products over K into
    its column of the [BLOCK_N, T_PAD] accumulator every step. Rows n >= N load row N-1 (in bounds,
    never stored); tokens t >= T are skipped (a uniform branch). A token's result is the same
    instruction sequence on the same registers whatever T is: row t of a T = 4 call equals the same
    row computed alone (same blocks). The first step is peeled off the loop so that its weight tile
    (weights: nothing in the step writes them) can be in flight before the PDL wait. The fp32 sums keep
    their order; with pick_blocks' shapes (one row a program) the code is the loop's twice over, so results
    are those of the unpeeled loop, while with hand-picked blocks of several rows and T >= 2 the compiler may
    contract multiply-adds differently than it did in the loop (a last-bit difference from before the peel;
    PDL on and off still agree: it is the same code).
    """
    j = tl.program_id(0)
    rows = j * BLOCK_N + tl.arange(0, BLOCK_N)                               # [BLOCK_N]
    toks = tl.arange(0, T_PAD)                                               # [T_PAD]
    cols = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn       # [BLOCK_N, 1]
    w_first = _load_w_tile(w_rows, cols[None, :], K, EVEN_K)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_N, T_PAD], dtype=tl.float32)
    acc = _gemv_step(acc, w_first, x_ptr, cols[None, :], K, T, stride_xt, toks, T_PAD, EVEN_K,
                     u_ptr, stride_ut, GLU, ACCURATE, EMU_BF16)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + cols[None, :]                                              # [1, BLOCK_K]
        wv = _load_w_tile(w_rows, kk, K, EVEN_K)                             # [BLOCK_N, BLOCK_K]
        acc = _gemv_step(acc, wv, x_ptr, kk, K, T, stride_xt, toks, T_PAD, EVEN_K,
                         u_ptr, stride_ut, GLU, ACCURATE, EMU_BF16)
    if BIAS:
        acc += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)[:, None]
    out = out_ptr + toks[None, :] * N + rows[:, None]                        # [BLOCK_N, T_PAD]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(toks[None, :] < T) & (rows[:, None] < N))

