"""The E2M1 formats' (mxfp4, nvfp4) K steps of the quantized decode GEMVs with the codes read as 32-bit words
(GemvBlocks.quant_words; quant_kernels.py's kernels call these steps when WORDS is set).

Why: the byte path (_weight_tile) loads codes as uint8 and pays, per byte, a byte extract (PRMT) before the
two nibbles' shift, shift, mask; the integer pipe, at half the float32 rate on sm_90, is what bounds these
kernels (docs/QUANTIZATION.md). A word holds 8 nibbles, k0 + 8j .. k0 + 8j + 7 in little-endian nibble order
(nibble i in bits 4i .. 4i + 3): shifted left by 28 - 4i it has nibble i in bits 31..28, and then the same
arithmetic shift and mask as the byte path place its float32 bits (value * 2**-126). No extract, and the top
nibble needs no left shift: 23 integer instructions for 8 weights where the bytes took 28.

Tiles: a program's codes are [BLOCK_N, NG, GW] words (GW = GL / 8 words of a group of GL columns), decoded to
[BLOCK_N, NG, GW, 8]; the activations load as [1, NG, GW, 8] in column order, so no split is needed. Always with
the scale a group's sum (GSUM form, _weight_tile's docstring): the decoded values stay * 2**-126, the activations
are scaled by GSUM_X and each group's sum by GSUM_UNDO and its scale. The decoded values are those of the byte path
bit for bit; only the order of the float32 sums differs (the lockstep tests' bound).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.moe_decode.quant_decode import (E2M1_MASK, FMT_MXFP4, GSUM_UNDO, GSUM_X, _e4m3_to_f32,
                                                      _e8m0_to_f32)


@triton.jit
def _words_tile(row_ptr, code_off, scale_off, rows, k0, NROWS, KDIM, row_bytes, n_scale_cols,
                FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """Rows `rows`, columns k0 .. k0 + BLOCK_K of one E2M1 matrix [NROWS, KDIM] -> (codes, s): codes
    [BLOCK_N, KW] int32 words (columns k0 + 8 j .. k0 + 8 j + 7 at [:, j]; masked-off ones 0, which decode to 0.0),
    s [BLOCK_N, KW] the scale of each word's group without nvfp4's global (mxfp4: 2**(e - 127); nvfp4: e4m3(s)).
    row_bytes: bytes of a code row (16-divisible: the words load 16 bytes at a time)."""
    KW: tl.constexpr = BLOCK_K // 8
    r2 = rows[:, None]                                                 # [BLOCK_N, 1]
    kw = tl.arange(0, KW)[None, :]                                     # [1, KW]
    col = k0 + kw * 8                                                  # each word's first column
    word_ptr = (row_ptr + code_off).to(tl.pointer_type(tl.int32)) + r2 * (row_bytes // 4) + (k0 // 8 + kw)
    sidx = r2 * n_scale_cols + col // GROUP                            # [BLOCK_N, KW] (a group's words repeat it)
    if MASK_N:
        if MASK_K:
            mask = (r2 < NROWS) & (col < KDIM)
        else:
            mask = (r2 < NROWS) & (col >= 0)
    else:
        if MASK_K:
            mask = (r2 >= 0) & (col < KDIM)
        else:
            mask = None
    if mask is None:
        codes = tl.load(word_ptr)
        sb = tl.load(row_ptr + scale_off + sidx)
    else:
        codes = tl.load(word_ptr, mask=mask, other=0)
        sb = tl.load(row_ptr + scale_off + sidx, mask=mask, other=0)
    if FMT == FMT_MXFP4:
        s = _e8m0_to_f32(sb.to(tl.int32))
    else:
        s = _e4m3_to_f32(sb)                                           # the global: once a row, after the loop
    return codes, s


@triton.jit
def _nib(codes, i: tl.constexpr):
    """Nibble i of each word -> its float32 bits (the value * 2**-126): to bits 31..28, then shifted and masked."""
    if i == 7:
        top = codes
    else:
        top = codes << (28 - 4 * i)
    return ((top >> 6) & E2M1_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _words_act(v_ptr, k0, KDIM, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of a vector, float32 times GSUM_X, as 8 tensors [1, KW]: v_i = column
    k0 + 8 j + i at [0, j] (one contiguous load, split three times)."""
    KW: tl.constexpr = BLOCK_K // 8
    cols = k0 + tl.arange(0, KW)[:, None, None, None] * 8 + (tl.arange(0, 2)[None, :, None, None] * 4
                                                             + tl.arange(0, 2)[None, None, :, None] * 2
                                                             + tl.arange(0, 2)[None, None, None, :])
    if MASK_K:
        v = tl.load(v_ptr + cols, mask=cols < KDIM, other=0.0)
    else:
        v = tl.load(v_ptr + cols)
    v = v.to(tl.float32) * GSUM_X                                      # [KW, 2, 2, 2]: i = 4a + 2b + c
    v_a0, v_a1 = tl.split(tl.permute(v, 0, 2, 3, 1))                   # by a
    v0, v2 = tl.split(tl.permute(v_a0, 0, 2, 1))                       # by b: [KW, 2] over c
    v4, v6 = tl.split(tl.permute(v_a1, 0, 2, 1))
    x0, x1 = tl.split(v0)
    x2, x3 = tl.split(v2)
    x4, x5 = tl.split(v4)
    x6, x7 = tl.split(v6)
    return x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :], x6[None, :], x7[None, :]


@triton.jit
def _word_sums(codes, s, x0, x1, x2, x3, x4, x5, x6, x7):
    """Each word's sum of its 8 weights times the activations, in nibble order (one multiply-add a weight),
    times its scale s -> [BLOCK_N, KW]; still * 2**-62 and without nvfp4's global: `finish` applies both."""
    t = _nib(codes, 0) * x0
    t += _nib(codes, 1) * x1
    t += _nib(codes, 2) * x2
    t += _nib(codes, 3) * x3
    t += _nib(codes, 4) * x4
    t += _nib(codes, 5) * x5
    t += _nib(codes, 6) * x6
    t += _nib(codes, 7) * x7
    return t * s


@triton.jit
def gate_up_words_step(acc_g, acc_u, x_row, k0, H, I, row_ptr, codes_off, up_codes, scales_gate_off, scales_up_off,
                       rows, code_row_bytes, n_scale_cols, FMT: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """One K step of moe_gate_up_quant_kernel with WORDS: gate's and up's word sums into acc_g, acc_u
    [BLOCK_N, BLOCK_K // 8]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _words_act(x_row, k0, H, BLOCK_K, MASK_K)
    wg, sg = _words_tile(row_ptr, codes_off, scales_gate_off, rows, k0, I, H, code_row_bytes, n_scale_cols,
                         FMT, GROUP, BLOCK_N, BLOCK_K, MASK_N, MASK_K)
    wu, su = _words_tile(row_ptr, up_codes, scales_up_off, rows, k0, I, H, code_row_bytes, n_scale_cols,
                         FMT, GROUP, BLOCK_N, BLOCK_K, MASK_N, MASK_K)
    return (acc_g + _word_sums(wg, sg, x0, x1, x2, x3, x4, x5, x6, x7),
            acc_u + _word_sums(wu, su, x0, x1, x2, x3, x4, x5, x6, x7))


@triton.jit
def down_words_step(acc, a_row, k0, H, I, row_ptr, codes_off, scales_off, rows, code_row_bytes,
                    n_scale_cols, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """One K step of moe_down_quant_kernel with WORDS (as gate_up_words_step)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _words_act(a_row, k0, I, BLOCK_K, MASK_K)
    w, s = _words_tile(row_ptr, codes_off, scales_off, rows, k0, H, I, code_row_bytes, n_scale_cols,
                       FMT, GROUP, BLOCK_N, BLOCK_K, MASK_N, MASK_K)
    return acc + _word_sums(w, s, a0, a1, a2, a3, a4, a5, a6, a7)


@triton.jit
def finish(acc, glob):
    """The word sums accumulated over K [BLOCK_N, KW] -> [BLOCK_N, KW, 1] with their values: times GSUM_UNDO
    and nvfp4's global (1.0 for mxfp4), once a row and not once a word."""
    return (acc * (glob * GSUM_UNDO))[:, :, None]
