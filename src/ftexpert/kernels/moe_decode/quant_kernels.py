"""Triton kernels over quantized expert slots (`quant.py` launches them; `quant_reference.py` is their oracle).

A slot row holds one expert in the byte layout of proto/expert_format.py (QuantLayout): codes, then
scales, then (int4) zero points, then (nvfp4) three float32 globals, every region 16-byte aligned. The
kernels read the codes as uint8 and decode them in registers to the float32 value
kernels.expert_reference.dequantize_matrix computes, bit for bit (same roundings, in the same order):

    fp8    w = e4m3(code) * scale[r // 128, k // 128]                        (scale float32)
    int4   w = (u - zero) * scale                                            (scale float32, zero uint8)
    mxfp4  w = e2m1(code) * 2**(e - 127)                                     (e: an E8M0 byte)
    nvfp4  w = e2m1(code) * (e4m3(s) * global)                               (s: an E4M3 byte)

Decoding uses integer and float32 multiply ops only, no conversion instructions (CUDA's throughput table
gives sm_90 16 conversions a clock per SM against 128 float32 operations, and decode should stay bound by
the bytes it reads): an E4M3 byte's bits moved into a
float32 (sign to bit 31, exponent and mantissa to bits 26..20) are its value times 2**-120, an E2M1
nibble's (bits 24..22) its value times 2**-126, both exact in float32 (subnormals included: the GPU's
mul.f32 does not flush them); one exact multiply by the power of two restores the value. An unsigned
nibble u is float32(2**23 + u) by OR-ing it into 2**23's bits, so u - zero = (2**23 + u) - (2**23 + zero)
exactly. E4M3's NaN codes (0x7f, 0xff; the quantizer never writes them) decode to +-480, not NaN.

Tiles: a program's rows are cut along K into NG groups of GL elements (GL = min(group, BLOCK_K), a
divisor of the format's group), so one scale (and zero) per (row, group) broadcasts over GL weights.
4-bit codes load as GL / 2 bytes per group and split into their low (even k) and high (odd k) nibbles;
the activations load contiguous and split the same way (tl.split), so the weight tiles stay in the layout
they were loaded in (interleaving the weights instead costs two layout conversions of the whole tile a
step); dequantize_rows interleaves (tl.join) before its store.

Legend as in triton_kernels.py: T tokens, K routes, P = T*K pairs, H hidden, I intermediate, S slot rows.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.pdl import pdl_enter

from ftexpert.kernels.moe_decode.triton_kernels import _div, _down_out, _exp, _gate_up_act, _route_active

FMT_FP8: tl.constexpr = tl.constexpr(0)
FMT_INT4: tl.constexpr = tl.constexpr(1)
FMT_MXFP4: tl.constexpr = tl.constexpr(2)
FMT_NVFP4: tl.constexpr = tl.constexpr(3)
E4M3_FIX: tl.constexpr = tl.constexpr(2.0 ** 120)     # float32 bits of an E4M3 byte moved into place: value * 2**-120
E2M1_FIX: tl.constexpr = tl.constexpr(2.0 ** 126)     # float32 bits of an E2M1 nibble moved into place: value * 2**-126
MAGIC_2P23: tl.constexpr = tl.constexpr(0x4B000000)   # float32 bits of 2**23
E4M3_MASK: tl.constexpr = tl.constexpr(0x87F00000 - (1 << 32))   # bits 31 and 26..20 (as an int32)
E2M1_MASK: tl.constexpr = tl.constexpr(0x81C00000 - (1 << 32))   # bits 31 and 24..22 (as an int32)
GSUM_X: tl.constexpr = tl.constexpr(2.0 ** 64)       # GSUM, E2M1: x scaled so that (value * 2**-126) * x' is normal
GSUM_UNDO: tl.constexpr = tl.constexpr(2.0 ** 62)    # ... and a group's sum scaled back: 2**126 / 2**64


@triton.jit
def _e4m3_to_f32(b):
    """uint8 E4M3 bytes -> their float32 values (exact; NaN codes give +-480). The byte
    sign-extended and shifted by 20 has the sign in bits 31..27 and exponent, mantissa in 26..20; the mask
    keeps bit 31 and 26..20 (one PRMT / shift / LOP3 a byte on the GPU)."""
    bits = (b.to(tl.int8, bitcast=True).to(tl.int32) << 20) & E4M3_MASK
    return bits.to(tl.float32, bitcast=True) * E4M3_FIX


@triton.jit
def _e2m1_bits(top):
    """int32 with an E2M1 nibble in bits 31..28 -> its float32 value * 2**-126 (exact, a subnormal or tiny
    normal): shifted right arithmetically by 6 and masked, the sign is in bit 31 and exponent, mantissa in bits
    24..22."""
    return ((top >> 6) & E2M1_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(top):
    """int32 with an E2M1 nibble in bits 31..28 -> its float32 value (exact, -0.0 for 0x8)."""
    return _e2m1_bits(top) * E2M1_FIX


@triton.jit
def _e8m0_to_f32(e):
    """int32 holding an E8M0 byte -> 2**(e - 127) in float32 (e = 0: the subnormal 2**-127; 255: inf)."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(row_ptr, code_off, scale_off, zero_off, glob, rows, k0, NROWS, KDIM, row_bytes, n_scale_cols,
                 FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
                 GSUM: tl.constexpr = False):
    """Rows `rows` [BLOCK_N], columns k0 .. k0 + BLOCK_K of one quantized matrix [NROWS, KDIM] of the expert
    at row_ptr (uint8), decoded to float32 -> (wa, wb). fp8: wa = wb = the weights [BLOCK_N, NG, GL]
    (column k0 + g * GL + c at [:, g, c]); 4-bit formats: wa = the even columns, wb = the odd ones, each
    [BLOCK_N, NG, GL / 2] (column k0 + g * GL + 2c (+1) at [:, g, c]), as the code bytes hold them.

    code_off: byte offset of the matrix's codes ([NROWS, row_bytes = KDIM * b] uint8; row_bytes an argument
    of its own, so that the JIT sees it 16-divisible: 16-byte code loads); scale_off / zero_off: byte
    offsets of its scales / zeros ([ceil(NROWS / ROW_BLOCK), n_scale_cols]); glob: nvfp4's float32 global.
    GROUP: the format's group along K (128 for fp8's blocks), ROW_BLOCK: rows a scale covers (128 for
    fp8, else 1). Masked-off weights (rows >= NROWS, columns >= KDIM) come out 0.0.
    Returns (wa, wb, s). GSUM (4-bit formats): the weights without their group's scale, which comes back as
    s [BLOCK_N, NG, 1] for the caller to apply to each group's sum (one multiply a group, not one a weight);
    for E2M1 also without the 2**126 that makes them their values (x' = x * GSUM_X and the group's sum times
    GSUM_UNDO restore it: every product exact up to a power of two). Otherwise s = 1.0 (already applied).
    """
    GL: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    NG: tl.constexpr = BLOCK_K // GL
    r3 = rows[:, None, None]                                           # [BLOCK_N, 1, 1]
    g3 = tl.arange(0, NG)[None, :, None]                               # [1, NG, 1]
    col0 = k0 + g3 * GL                                                # first column of each group
    if MASK_N:
        if MASK_K:
            gmask = (r3 < NROWS) & (col0 < KDIM)                       # [BLOCK_N, NG, 1]
        else:
            gmask = (r3 < NROWS) & (col0 >= 0)
    else:
        if MASK_K:
            gmask = (r3 >= 0) & (col0 < KDIM)
        else:
            gmask = None
    sidx = (r3 // ROW_BLOCK) * n_scale_cols + col0 // GROUP            # [BLOCK_N, NG, 1]
    if FMT == FMT_FP8:
        c3 = tl.arange(0, GL)[None, None, :]                           # [1, 1, GL]
        offs = r3 * row_bytes + col0 + c3                              # [BLOCK_N, NG, GL]
        scale_ptr = (row_ptr + scale_off).to(tl.pointer_type(tl.float32))
        if MASK_K:                                                     # fp8: K need not fill its last block
            emask = (col0 + c3) < KDIM
            if MASK_N:
                emask = emask & (r3 < NROWS)
            codes = tl.load(row_ptr + code_off + offs, mask=emask, other=0)
        elif MASK_N:
            codes = tl.load(row_ptr + code_off + offs, mask=(r3 < NROWS) & (c3 >= 0), other=0)
        else:
            codes = tl.load(row_ptr + code_off + offs)
        if gmask is None:
            s = tl.load(scale_ptr + sidx)
        else:
            s = tl.load(scale_ptr + sidx, mask=gmask, other=0.0)
        wa = _e4m3_to_f32(codes) * s
        wb = wa
        s = 1.0
    else:
        HB: tl.constexpr = GL // 2                                     # bytes of a group's GL 4-bit codes
        b3 = tl.arange(0, HB)[None, None, :]
        offs = r3 * row_bytes + k0 // 2 + g3 * HB + b3                 # [BLOCK_N, NG, HB]
        if gmask is None:
            codes = tl.load(row_ptr + code_off + offs).to(tl.int32)
        else:
            codes = tl.load(row_ptr + code_off + offs, mask=gmask & (b3 >= 0), other=0).to(tl.int32)
        if FMT == FMT_INT4:
            lo = codes & 0xF                                           # even k
            hi = codes >> 4                                            # odd k
            scale_ptr = (row_ptr + scale_off).to(tl.pointer_type(tl.float32))
            if gmask is None:
                s = tl.load(scale_ptr + sidx)
                z = tl.load(row_ptr + zero_off + sidx).to(tl.int32)
            else:
                s = tl.load(scale_ptr + sidx, mask=gmask, other=0.0)
                z = tl.load(row_ptr + zero_off + sidx, mask=gmask, other=0).to(tl.int32)
            zf = (z | MAGIC_2P23).to(tl.float32, bitcast=True)         # 2**23 + zero
            wa = (lo | MAGIC_2P23).to(tl.float32, bitcast=True) - zf
            wb = (hi | MAGIC_2P23).to(tl.float32, bitcast=True) - zf
            if not GSUM:
                wa = wa * s
                wb = wb * s
                s = 1.0
        else:
            if gmask is None:
                sb = tl.load(row_ptr + scale_off + sidx)
            else:
                sb = tl.load(row_ptr + scale_off + sidx, mask=gmask, other=0)
            if FMT == FMT_MXFP4:
                s = _e8m0_to_f32(sb.to(tl.int32))
            else:
                s = _e4m3_to_f32(sb) * glob                            # fp32(e4m3(s) * global), as the codec
            if GSUM:                                                   # the values * 2**-126
                wa = _e2m1_bits(codes << 28)
                wb = _e2m1_bits(codes << 24)
            else:
                wa = _e2m1_to_f32(codes << 28) * s                     # the low nibble to bits 31..28
                wb = _e2m1_to_f32(codes << 24) * s                     # the high one
                s = 1.0
    return wa, wb, s


@triton.jit
def _act_tile(v_ptr, k0, KDIM, FMT: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
              MASK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of a vector (x or act) in float32, in _weight_tile's shapes: (va, vb)
    [1, NG, GL] both for fp8; the even and the odd columns [1, NG, GL / 2] for the 4-bit formats (one
    contiguous load, split: the weight tiles stay in the layout they were loaded in)."""
    GL: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    NG: tl.constexpr = BLOCK_K // GL
    g3 = k0 + tl.arange(0, NG)[None, :, None] * GL
    if FMT == FMT_FP8:
        cols = g3 + tl.arange(0, GL)[None, None, :]
        if MASK_K:
            va = tl.load(v_ptr + cols, mask=cols < KDIM, other=0.0).to(tl.float32)
        else:
            va = tl.load(v_ptr + cols).to(tl.float32)
        vb = va
    else:
        cols = (g3 + tl.arange(0, GL // 2)[None, None, :] * 2)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
        if MASK_K:
            v = tl.load(v_ptr + cols, mask=cols < KDIM, other=0.0)
        else:
            v = tl.load(v_ptr + cols)
        va, vb = tl.split(v.to(tl.float32))
    return va, vb


@triton.jit
def _gsum_act(va, vb, FMT: tl.constexpr):
    """GSUM: the activation tiles as the undecoded E2M1 weights need them (times GSUM_X; int4: as they are)."""
    if FMT == FMT_INT4:
        return va, vb
    return va * GSUM_X, vb * GSUM_X


@triton.jit
def _gsum_scale(part, s, FMT: tl.constexpr):
    """GSUM: a group's sum [BLOCK_N, NG, 1] times its scale (E2M1: first times GSUM_UNDO, back to the values)."""
    if FMT == FMT_INT4:
        return part * s
    return (part * GSUM_UNDO) * s


@triton.jit
def _nvfp4_global(row_ptr, glob_off, which, FMT: tl.constexpr):
    """nvfp4: the float32 global scale of matrix `which` (0 gate, 1 up, 2 down); 1.0 for other formats."""
    if FMT == FMT_NVFP4:
        g = tl.load((row_ptr + glob_off).to(tl.pointer_type(tl.float32)) + which)
    else:
        g = 1.0
    return g


@triton.jit
def _gate_up_step(acc_g, acc_u, x_row, k0, H, I, row_ptr, codes_off, up_codes, scales_gate_off, scales_up_off,
                  zeros_gate_off, zeros_up_off, g_gate, g_up, rows, code_row_bytes, n_scale_cols,
                  FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr, GS: tl.constexpr):
    """One K step of moe_gate_up_quant_kernel: columns k0 .. k0 + BLOCK_K of gate's and up's rows into their
    accumulators. MASK_K only for the ragged last step (the kernel runs the whole steps unmasked first)."""
    xa, xb = _act_tile(x_row, k0, H, FMT, BLOCK_K, GROUP, MASK_K)
    ga, gb, sg = _weight_tile(row_ptr, codes_off, scales_gate_off, zeros_gate_off, g_gate, rows, k0, I, H,
                              code_row_bytes, n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K, MASK_N, MASK_K, GS)
    ua, ub, su = _weight_tile(row_ptr, up_codes, scales_up_off, zeros_up_off, g_up, rows, k0, I, H,
                              code_row_bytes, n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K, MASK_N, MASK_K, GS)
    if FMT == FMT_FP8:
        acc_g += ga * xa
        acc_u += ua * xa
    elif GS:                                                           # a group's sum, then its scale
        xa, xb = _gsum_act(xa, xb, FMT)
        acc_g += _gsum_scale(tl.expand_dims(tl.sum(ga * xa + gb * xb, axis=2), 2), sg, FMT)
        acc_u += _gsum_scale(tl.expand_dims(tl.sum(ua * xa + ub * xb, axis=2), 2), su, FMT)
    else:                                                              # even columns, then odd ones
        acc_g += ga * xa                                               # (two fused multiply-adds)
        acc_g += gb * xb
        acc_u += ua * xa
        acc_u += ub * xb
    return acc_g, acc_u


@triton.jit
def _down_step(acc, a_row, k0, H, I, row_ptr, codes_off, scales_off, zeros_off, g_down, rows, code_row_bytes,
               n_scale_cols, FMT: tl.constexpr, GROUP: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr, GS: tl.constexpr):
    """One K step of moe_down_quant_kernel (as _gate_up_step)."""
    aa, ab = _act_tile(a_row, k0, I, FMT, BLOCK_K, GROUP, MASK_K)
    wa, wb, sw = _weight_tile(row_ptr, codes_off, scales_off, zeros_off, g_down, rows, k0, H, I, code_row_bytes,
                              n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K, MASK_N, MASK_K, GS)
    if FMT == FMT_FP8:
        acc += wa * aa
    elif GS:
        aa, ab = _gsum_act(aa, ab, FMT)
        acc += _gsum_scale(tl.expand_dims(tl.sum(wa * aa + wb * ab, axis=2), 2), sw, FMT)
    else:
        acc += wa * aa
        acc += wb * ab
    return acc


@triton.jit
def moe_gate_up_quant_kernel(
    x_ptr,                # [T, H] x.dtype, row stride stride_xt, columns contiguous
    ids_ptr,              # [P] int32|int64: slot rows (-1: pair not on the GPU)
    rows_ptr,             # [S, stride_row] uint8: one expert per row (QuantLayout)
    act_ptr,              # [P, I] x.dtype out: silu(gate) * up
    plan_ptr, nplan_ptr,  # PLAN > 0: the copy plan's slots (int32) and its length (int32 [1])
    extra_slot,           # PLAN > 0: a slot counted as in the plan (-2: none), see _route_active
    K, H, I,
    stride_xt, stride_row,
    codes_off,            # byte offset of codes_w13 [2I, H * b] in a row (gate rows, then up rows)
    code_row_bytes,       # H * b: bytes of a code row
    scales_gate_off, scales_up_off,  # byte offsets of gate's and up's scales
    zeros_gate_off, zeros_up_off,    # int4: byte offsets of gate's and up's zero points
    glob_off,             # nvfp4: byte offset of the float32 globals [3]
    n_scale_cols,         # scale columns of gate / up: ceil(H / 128) (fp8) or H / group
    FMT: tl.constexpr,        # FMT_FP8 | FMT_INT4 | FMT_MXFP4 | FMT_NVFP4
    GROUP: tl.constexpr,      # columns a scale covers (128 for fp8)
    ROW_BLOCK: tl.constexpr,  # rows a scale covers (128 for fp8, else 1)
    BLOCK_N: tl.constexpr,    # gate rows (and as many up rows) per program
    BLOCK_K: tl.constexpr,    # hidden columns per loop step (a multiple of min(GROUP, BLOCK_K))
    EVEN_N: tl.constexpr,     # I % BLOCK_N == 0: no row masks
    EVEN_K: tl.constexpr,     # H % BLOCK_K == 0: no column masks
    ACCURATE: tl.constexpr,
    PLAN: tl.constexpr,       # 0: every route; 1: routes not in the plan; 2: routes in it (_route_active)
    PLAN_MAX: tl.constexpr,   # power of two >= the plan's largest length
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
    b13_ptr=None, stride_b=0, alpha=0.0, limit=0.0,   # BIAS / SWIGLU: as moe_gate_up_kernel
    BIAS: tl.constexpr = False,
    SWIGLU: tl.constexpr = False,
    GSUM: tl.constexpr = False,      # 4-bit formats: each group's scale applied to its sum (_weight_tile)
):
    """Grid (P, cdiv(I, BLOCK_N)): moe_gate_up_kernel over quantized rows. gate = w_gate[n] . x[t] and
    up = w_up[n] . x[t] in fp32 with the decoded float32 weights, each rounded to x.dtype; silu(gate)
    rounded; silu(gate) * up rounded (BIAS / SWIGLU: triton_kernels._gate_up_act). A pair with id < 0 reads
    and writes nothing."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        DT = act_ptr.dtype.element_ty
        GL: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
        NG: tl.constexpr = BLOCK_K // GL
        t = p // K
        rows = j * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N] gate rows
        row_ptr = rows_ptr + e * stride_row
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        up_codes = codes_off + I * code_row_bytes
        g_gate = _nvfp4_global(row_ptr, glob_off, 0, FMT)
        g_up = _nvfp4_global(row_ptr, glob_off, 1, FMT)
        GA: tl.constexpr = GL if FMT == FMT_FP8 else GL // 2
        GS: tl.constexpr = GSUM and FMT != FMT_FP8
        GA2: tl.constexpr = 1 if GS else GA
        acc_g = tl.zeros([BLOCK_N, NG, GA2], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, NG, GA2], dtype=tl.float32)
        k_full = H // BLOCK_K * BLOCK_K                                # whole steps unmasked, then the ragged one
        for k0 in range(0, k_full, BLOCK_K):
            acc_g, acc_u = _gate_up_step(acc_g, acc_u, x_row, k0, H, I, row_ptr, codes_off, up_codes, scales_gate_off,
                                         scales_up_off, zeros_gate_off, zeros_up_off, g_gate, g_up, rows,
                                         code_row_bytes, n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K,
                                         not EVEN_N, False, GS)
        if not EVEN_K:
            acc_g, acc_u = _gate_up_step(acc_g, acc_u, x_row, k_full, H, I, row_ptr, codes_off, up_codes,
                                         scales_gate_off, scales_up_off, zeros_gate_off, zeros_up_off, g_gate, g_up,
                                         rows, code_row_bytes, n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K,
                                         not EVEN_N, True, GS)
        act = _gate_up_act(tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1), e, rows,
                           I, b13_ptr, stride_b, alpha, limit, DT, ACCURATE, BIAS, SWIGLU)
        if EVEN_N:
            tl.store(act_ptr + p.to(tl.int64) * I + rows, act)
        else:
            tl.store(act_ptr + p.to(tl.int64) * I + rows, act, mask=rows < I)


@triton.jit
def moe_down_quant_kernel(
    act_ptr,              # [P, I] x.dtype: silu(gate) * up
    ids_ptr,              # [P] int32|int64: slot rows (-1: pair not on the GPU)
    rw_ptr,               # [P] routing weights (read as fp32)
    rows_ptr,             # [S, stride_row] uint8 (QuantLayout rows)
    y_ptr,                # [P, H] fp32 out: w_k * down (down rounded to x.dtype first)
    plan_ptr, nplan_ptr,  # as in moe_gate_up_quant_kernel
    extra_slot,
    H, I,
    stride_row,
    codes_off,            # byte offset of codes_w2 [H, I * b]
    code_row_bytes,       # I * b: bytes of a code row
    scales_off,           # byte offset of scales_w2
    zeros_off,            # int4: byte offset of zeros_w2
    glob_off,             # nvfp4: byte offset of the globals (down's is the third)
    n_scale_cols,         # scale columns of down: ceil(I / 128) (fp8) or I / group
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,    # output rows (of H) per program
    BLOCK_K: tl.constexpr,    # intermediate columns per loop step
    EVEN_N: tl.constexpr,     # H % BLOCK_N == 0
    EVEN_K: tl.constexpr,     # I % BLOCK_K == 0
    PLAN: tl.constexpr,
    PLAN_MAX: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    b2_ptr=None, stride_b=0,  # BIAS: down's biases [S, H] (triton_kernels._down_out)
    BIAS: tl.constexpr = False,
    GSUM: tl.constexpr = False,   # as moe_gate_up_quant_kernel
):
    """Grid (P, cdiv(H, BLOCK_N)): y[p, n] = float(x.dtype(w2[n] . act[p] (+ b2[n]))) * w[p] (fp32), w2 decoded
    in registers; exactly 0.0 for a pair with id < 0, which reads neither weights nor its act row."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        rows = j * BLOCK_N + tl.arange(0, BLOCK_N)
        y_row = y_ptr + p.to(tl.int64) * H
        if e >= 0:
            DT = act_ptr.dtype.element_ty
            GL: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
            NG: tl.constexpr = BLOCK_K // GL
            row_ptr = rows_ptr + e * stride_row
            a_row = act_ptr + p.to(tl.int64) * I
            g_down = _nvfp4_global(row_ptr, glob_off, 2, FMT)
            GA: tl.constexpr = GL if FMT == FMT_FP8 else GL // 2
            GS: tl.constexpr = GSUM and FMT != FMT_FP8
            GA2: tl.constexpr = 1 if GS else GA
            acc = tl.zeros([BLOCK_N, NG, GA2], dtype=tl.float32)
            k_full = I // BLOCK_K * BLOCK_K                            # whole steps unmasked, then the ragged one
            for k0 in range(0, k_full, BLOCK_K):
                acc = _down_step(acc, a_row, k0, H, I, row_ptr, codes_off, scales_off, zeros_off, g_down, rows,
                                 code_row_bytes, n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K, not EVEN_N,
                                 False, GS)
            if not EVEN_K:
                acc = _down_step(acc, a_row, k_full, H, I, row_ptr, codes_off, scales_off, zeros_off, g_down, rows,
                                 code_row_bytes, n_scale_cols, FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K, not EVEN_N,
                                 True, GS)
            y = _down_out(tl.sum(tl.sum(acc, axis=2), axis=1), e, rows, H, b2_ptr, stride_b,
                          tl.load(rw_ptr + p).to(tl.float32), DT, BIAS)               # [BLOCK_N]
        else:
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
        if EVEN_N:
            tl.store(y_row + rows, y)
        else:
            tl.store(y_row + rows, y, mask=rows < H)


@triton.jit
def dequantize_rows_kernel(
    rows_ptr,             # [S, stride_row] uint8 (QuantLayout rows)
    ids_ptr,              # [n] int32|int64: the slot rows to decode (-1: write zeros)
    out_ptr,              # [n, stride_out] out_dtype: per expert w13 [2I, H] then w2 [H, I] (ExpertLayout)
    H, I,
    stride_row, stride_out,
    codes13_off, codes2_off,
    code_row13, code_row2,                # bytes of a code row of gate / up (H * b) and of down (I * b)
    scales_gate_off, scales_up_off, scales2_off,
    zeros_gate_off, zeros_up_off, zeros2_off,
    glob_off,
    n_scale_cols13, n_scale_cols2,
    tiles_w13_k, tiles_w13, tiles_w2_k,   # column tiles of gate / up; tiles of gate (= of up); column tiles of down
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,    # rows per tile
    BLOCK_K: tl.constexpr,    # columns per tile
    USE_PDL: tl.constexpr = False,
):
    """Grid (n, 2 * tiles_w13 + tiles of down): program (i, q) decodes one [BLOCK_N, BLOCK_K] tile of gate
    (q < tiles_w13), up, or down of expert ids[i] into float32 (bit-identical to dequantize_matrix) and
    stores it in out_dtype (round to nearest even)."""
    pdl_enter(USE_PDL)
    i = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)
    e = tl.load(ids_ptr + i).to(tl.int64)
    valid = e >= 0
    row_ptr = rows_ptr + tl.where(valid, e, 0) * stride_row
    out_row = out_ptr + i * stride_out
    if q < 2 * tiles_w13:                     # gate or up: [I, H]
        which = q // tiles_w13
        qq = q - which * tiles_w13
        rt = qq // tiles_w13_k
        kt = qq - rt * tiles_w13_k
        nrows = I
        kdim = H
        code_off = codes13_off + which * I * code_row13
        row_bytes = code_row13
        scale_off = tl.where(which == 0, scales_gate_off, scales_up_off)
        zero_off = tl.where(which == 0, zeros_gate_off, zeros_up_off)
        n_cols = n_scale_cols13
        out_base = out_row + which * I * H
    else:                                     # down: [H, I]
        which = q * 0 + 2
        qq = q - 2 * tiles_w13
        rt = qq // tiles_w2_k
        kt = qq - rt * tiles_w2_k
        nrows = H
        kdim = I
        code_off = codes2_off
        row_bytes = code_row2
        scale_off = scales2_off
        zero_off = zeros2_off
        n_cols = n_scale_cols2
        out_base = out_row + 2 * I * H
    GL: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    NG: tl.constexpr = BLOCK_K // GL
    rows = rt * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = kt * BLOCK_K
    glob = _nvfp4_global(row_ptr, glob_off, which, FMT)
    wa, wb, _ = _weight_tile(row_ptr, code_off, scale_off, zero_off, glob, rows, k0, nrows, kdim, row_bytes, n_cols,
                          FMT, GROUP, ROW_BLOCK, BLOCK_N, BLOCK_K, True, True)
    if FMT == FMT_FP8:
        w = wa
    else:
        w = tl.reshape(tl.join(wa, wb), [BLOCK_N, NG, GL])             # back to k order
    w = tl.where(valid, w, 0.0)
    r3 = rows[:, None, None]
    cols = k0 + tl.arange(0, NG)[None, :, None] * GL + tl.arange(0, GL)[None, None, :]
    tl.store(out_base + r3 * kdim + cols, w.to(out_ptr.dtype.element_ty), mask=(r3 < nrows) & (cols < kdim))
