"""The 4-bit gate/up and down GEMVs on the tensor cores (GemvBlocks.quant_mma, quant_mma_down; mxfp4 and nvfp4
experts): what `moe_gate_up_quant_kernel` and `moe_down_quant_kernel` compute, with the products summed by `tl.dot`
instead of float32 multiply-adds.

Why (docs/QUANTIZATION.md, the Nsight profile): the float32 path issues 7-12 instructions a weight, about 3.7 of
them to place a nibble's bits as a float32, and is bound by instruction issue at 19-45% of the HBM rate. Here:

- **Decode, two weights an instruction.** An E2M1 nibble's bits moved into a bfloat16 (sign to bit 15, exponent
  and mantissa to bits 8..6) are its value times 2**-126, exact (0.5 is a bfloat16 subnormal); two such halves fill
  a 32-bit register. `DECODE_ASM` turns 4 code bytes (8 weights) into 4 registers of bfloat16 pairs with 15
  integer instructions: the low nibbles shifted up into the high ones' place, each byte moved under a half by a
  byte permute with zeros beside it, one shift and one 3-input logic op a pair.
- **Group sums on the tensor cores.** The activations of a K step go into a block-diagonal matrix X [NG, BLOCK_K/2]
  (row g: group g's columns, zero elsewhere), so dot(X, W) [NG, BLOCK_N] is every (group, row) sum at once; each is
  then multiplied by its scale (one multiply-add a group, not a weight). The products are exact in float32
  (bfloat16 times bfloat16), the sums the tensor cores' float32 accumulation: the order of summation is the only
  difference from the reference's float32 sums, as for every block size of the float32 path.
- **Scaling.** The weights are value x 2**-126 and the activations are multiplied by 2**XS before they are rounded
  to bfloat16 (exact for bfloat16 activations), so every product is a normal float32; UNDO = 2**(126 - XS) restores
  the sums before the scales. Activations of another dtype would lose bits in that rounding: the launcher refuses
  them on a GPU.
- **Split K.** A program covers BLOCK_N gate rows and as many up rows over one of SPLIT column ranges (grid
  (P, cdiv(I, BLOCK_N), SPLIT)): the tensor cores want tens of rows a program, which alone leaves too few programs
  for a 512-wide expert. With SPLIT > 1 each program writes its gate and up sums to parts [SPLIT, P, 2, I] float32
  and `moe_act_from_parts_kernel` adds them in split order (deterministic) before the activation; down's ranges
  likewise go through parts [SPLIT, P, H] and `moe_down_from_parts_kernel` (before down's rounding to x.dtype and
  the routing weight).

Under the Triton interpreter (CI) the decode is the float32 one (`_e2m1_bits`, the same values) and the dots are
float32 (`input_precision="ieee"`): the same sums in another precision of the operands. tests/kernels/
test_moe_decode_quant_mma.py checks DECODE_ASM's instruction sequence, emulated bit by bit, against the codec.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.pdl import pdl_enter

from ftexpert.kernels.moe_decode.quant_kernels import FMT_NVFP4, _e2m1_bits, _e4m3_to_f32, _e8m0_to_f32, _nvfp4_global
from ftexpert.kernels.moe_decode.triton_kernels import _down_out, _gate_up_act, _route_active, route_sum

XS = 100                                                      # activations x 2**XS before their bfloat16 rounding
X_SCALE: tl.constexpr = tl.constexpr(2.0 ** XS)
UNDO: tl.constexpr = tl.constexpr(2.0 ** (126 - XS))          # the group sums back to their values

# 4 code bytes ($4; byte i = columns 2i (low nibble) and 2i + 1 (high nibble)) -> bfloat16 bits of e2m1 * 2**-126:
# $0, $1 the low nibbles of bytes (0, 1) and (2, 3), $2, $3 the high nibbles, each a pair (element 2i in the low
# half). wl: the low nibbles moved into the high ones' place; prmt: bytes i and i + 1 under bits 8..15 and 24..31
# with zero bytes beside them (selector nibbles 4: the zero register's byte); then sign (bit 15 / 31) from v and
# exponent, mantissa (bits 12..14 / 28..30 shifted to 6..8 / 22..24) from v >> 6: lop3 0xA8 = c & (a | b), c the
# mask 0x81C081C0. Emulated in tests/kernels/test_moe_decode_quant_mma.py.
DECODE_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 wl, wh, v;
and.b32 wh, $4, 0xF0F0F0F0;
shl.b32 wl, $4, 4;
and.b32 wl, wl, 0xF0F0F0F0;
prmt.b32 v, wl, 0, 0x1404;
shr.u32 $0, v, 6;
lop3.b32 $0, v, $0, 0x81C081C0, 0xA8;
prmt.b32 v, wl, 0, 0x3424;
shr.u32 $1, v, 6;
lop3.b32 $1, v, $1, 0x81C081C0, 0xA8;
prmt.b32 v, wh, 0, 0x1404;
shr.u32 $2, v, 6;
lop3.b32 $2, v, $2, 0x81C081C0, 0xA8;
prmt.b32 v, wh, 0, 0x3424;
shr.u32 $3, v, 6;
lop3.b32 $3, v, $3, 0x81C081C0, 0xA8;
}
""")


@triton.jit
def _e2m1_tiles(codes, ASM: tl.constexpr):
    """uint8 code tile [HB, BLOCK_N] -> (even, odd) weights, each [HB, BLOCK_N]: e2m1 * 2**-126, bfloat16 (ASM) or
    float32 (the interpreter's path, the same values)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r", [codes], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        c = codes.to(tl.int32)
        lo = _e2m1_bits(c << 28)
        hi = _e2m1_bits(c << 24)
    return lo, hi


@triton.jit
def _group_scales(row_ptr, scale_off, glob, rows, g0, n_scale_cols, smask, FMT: tl.constexpr, NG: tl.constexpr,
                  MASKED: tl.constexpr):
    """The scales of groups g0 .. g0 + NG of `rows` as float32 [NG, BLOCK_N] (nvfp4: e4m3 x global; mxfp4: E8M0)."""
    sidx = rows[None, :] * n_scale_cols + g0 + tl.arange(0, NG)[:, None]
    if MASKED:
        sb = tl.load(row_ptr + scale_off + sidx, mask=smask, other=0)
    else:
        sb = tl.load(row_ptr + scale_off + sidx)
    if FMT == FMT_NVFP4:
        s = _e4m3_to_f32(sb) * glob
    else:
        s = _e8m0_to_f32(sb.to(tl.int32))
    return s


@triton.jit
def _block_diag(v_row, k0, KDIM, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
                ASM: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of a vector (x or act), times 2**XS, as the block-diagonal (even, odd) operands
    [NG, BLOCK_K / 2]: row g holds group g's columns, zeros elsewhere (bfloat16 with ASM, else float32)."""
    HB: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // GROUP
    c = tl.arange(0, HB)
    if MASK_K:
        ve = tl.load(v_row + k0 + 2 * c, mask=k0 + 2 * c < KDIM, other=0.0).to(tl.float32)
        vo = tl.load(v_row + k0 + 2 * c + 1, mask=k0 + 2 * c + 1 < KDIM, other=0.0).to(tl.float32)
    else:
        ve = tl.load(v_row + k0 + 2 * c).to(tl.float32)
        vo = tl.load(v_row + k0 + 2 * c + 1).to(tl.float32)
    diag = (c[None, :] // (GROUP // 2)) == tl.arange(0, NG)[:, None]   # [NG, HB]: column c is in group g
    va = tl.where(diag, ve[None, :] * X_SCALE, 0.0)
    vb = tl.where(diag, vo[None, :] * X_SCALE, 0.0)
    if ASM:
        va = va.to(tl.bfloat16)
        vb = vb.to(tl.bfloat16)
    return va, vb


@triton.jit
def _group_sums(va, vb, k0, KDIM, row_ptr, codes_off, scale_off, glob, rows, code_row_bytes, n_scale_cols, row_ok,
                FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                MASK_K: tl.constexpr, ASM: tl.constexpr):
    """One matrix's rows `rows`, columns k0 .. k0 + BLOCK_K, against the block-diagonal operands: its (group, row)
    sums times their scales, [NG, BLOCK_N] float32."""
    HB: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // GROUP
    c = tl.arange(0, HB)
    g = tl.arange(0, NG)
    MASKED: tl.constexpr = MASK_K or not EVEN_N
    offs = rows[None, :] * code_row_bytes + k0 // 2 + c[:, None]       # [HB, BLOCK_N]: byte c of each row
    if MASKED:
        if MASK_K:
            cmask = row_ok[None, :] & (k0 + 2 * c[:, None] < KDIM)
            smask = row_ok[None, :] & (k0 + g[:, None] * GROUP < KDIM)
        else:
            cmask = row_ok[None, :] & (c[:, None] >= 0)
            smask = row_ok[None, :] & (g[:, None] >= 0)
        we, wo = _e2m1_tiles(tl.load(row_ptr + codes_off + offs, mask=cmask, other=0), ASM)
    else:
        smask = None
        we, wo = _e2m1_tiles(tl.load(row_ptr + codes_off + offs), ASM)
    scale = _group_scales(row_ptr, scale_off, glob, rows, k0 // GROUP, n_scale_cols, smask, FMT, NG, MASKED)
    if ASM:
        part = tl.dot(vb, wo, tl.dot(va, we))
    else:
        part = tl.dot(vb, wo, tl.dot(va, we, input_precision="ieee"), input_precision="ieee")
    return (part * UNDO) * scale


@triton.jit
def moe_gate_up_quant_mma_kernel(
    x_ptr, ids_ptr, rows_ptr, act_ptr,   # as moe_gate_up_quant_kernel
    parts_ptr,            # SPLIT > 1: [SPLIT, P, 2, I] float32 out: each split's gate and up sums
    plan_ptr, nplan_ptr, extra_slot,
    K, H, I, P,
    stride_xt, stride_row,
    codes_off, code_row_bytes, scales_gate_off, scales_up_off, glob_off, n_scale_cols,
    k_split,              # columns a split covers (a multiple of BLOCK_K)
    FMT: tl.constexpr,        # FMT_MXFP4 | FMT_NVFP4
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,    # gate rows (and as many up rows) a program, >= 16
    BLOCK_K: tl.constexpr,    # columns a K step: BLOCK_K / GROUP >= 16 groups (the dot's M)
    EVEN_N: tl.constexpr,     # I % BLOCK_N == 0: no row masks on the loads
    EVEN_K: tl.constexpr,     # H % BLOCK_K == 0
    ACCURATE: tl.constexpr,
    PLAN: tl.constexpr,
    PLAN_MAX: tl.constexpr,
    SPLIT: tl.constexpr,
    ASM: tl.constexpr,        # the bfloat16 decode and dots (a GPU); else the interpreter's float32 path
    USE_PDL: tl.constexpr = False,
    b13_ptr=None, stride_b=0, alpha=0.0, limit=0.0,
    BIAS: tl.constexpr = False,
    SWIGLU: tl.constexpr = False,
):
    """Grid (P, cdiv(I, BLOCK_N), SPLIT): moe_gate_up_quant_kernel's act (SPLIT 1), or the split's gate and up sums
    into parts (the activation then by moe_act_from_parts_kernel). A pair with id < 0 reads and writes nothing."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        NG: tl.constexpr = BLOCK_K // GROUP
        t = p // K
        rows = j * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < I
        row_ptr = rows_ptr + e * stride_row
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        up_codes = codes_off + I * code_row_bytes
        g_gate = _nvfp4_global(row_ptr, glob_off, 0, FMT)
        g_up = _nvfp4_global(row_ptr, glob_off, 1, FMT)
        acc_g = tl.zeros([NG, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([NG, BLOCK_N], dtype=tl.float32)
        k_lo = s * k_split
        k_hi = tl.minimum(k_lo + k_split, H)
        k_full = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K                # whole steps unmasked, then the ragged one
        for k0 in range(k_lo, k_full, BLOCK_K):
            xa, xb = _block_diag(x_row, k0, H, GROUP, BLOCK_K, False, ASM)
            acc_g += _group_sums(xa, xb, k0, H, row_ptr, codes_off, scales_gate_off, g_gate, rows, code_row_bytes,
                                 n_scale_cols, row_ok, FMT, GROUP, BLOCK_K, EVEN_N, False, ASM)
            acc_u += _group_sums(xa, xb, k0, H, row_ptr, up_codes, scales_up_off, g_up, rows, code_row_bytes,
                                 n_scale_cols, row_ok, FMT, GROUP, BLOCK_K, EVEN_N, False, ASM)
        if not EVEN_K:
            if k_full < k_hi:
                xa, xb = _block_diag(x_row, k_full, H, GROUP, BLOCK_K, True, ASM)
                acc_g += _group_sums(xa, xb, k_full, H, row_ptr, codes_off, scales_gate_off, g_gate, rows,
                                     code_row_bytes, n_scale_cols, row_ok, FMT, GROUP, BLOCK_K, EVEN_N, True, ASM)
                acc_u += _group_sums(xa, xb, k_full, H, row_ptr, up_codes, scales_up_off, g_up, rows,
                                     code_row_bytes, n_scale_cols, row_ok, FMT, GROUP, BLOCK_K, EVEN_N, True, ASM)
        gate = tl.sum(acc_g, axis=0)
        up = tl.sum(acc_u, axis=0)
        if SPLIT == 1:
            act = _gate_up_act(gate, up, e, rows, I, b13_ptr, stride_b, alpha, limit, act_ptr.dtype.element_ty,
                               ACCURATE, BIAS, SWIGLU)
            tl.store(act_ptr + p.to(tl.int64) * I + rows, act, mask=row_ok)
        else:
            base = parts_ptr + (s.to(tl.int64) * P + p) * (2 * I)
            tl.store(base + rows, gate, mask=row_ok)
            tl.store(base + I + rows, up, mask=row_ok)


@triton.jit
def moe_act_from_parts_kernel(
    parts_ptr,            # [SPLIT, P, 2, I] float32: each split's gate and up sums
    ids_ptr, act_ptr, plan_ptr, nplan_ptr, extra_slot,
    P, I,
    BLOCK: tl.constexpr,
    ACCURATE: tl.constexpr,
    PLAN: tl.constexpr,
    PLAN_MAX: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    b13_ptr=None, stride_b=0, alpha=0.0, limit=0.0,
    BIAS: tl.constexpr = False,
    SWIGLU: tl.constexpr = False,
):
    """Grid (P, cdiv(I, BLOCK)): act[p] from the splits' sums, added in split order; the pairs the gate/up launch
    skipped (id < 0, or another launch's routes) are skipped here too."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        rows = j * BLOCK + tl.arange(0, BLOCK)
        ok = rows < I
        base = parts_ptr + p.to(tl.int64) * (2 * I)
        gate = route_sum(base, rows, ok, SPLIT, P * (2 * I))
        up = route_sum(base + I, rows, ok, SPLIT, P * (2 * I))
        act = _gate_up_act(gate, up, e, rows, I, b13_ptr, stride_b, alpha, limit, act_ptr.dtype.element_ty,
                           ACCURATE, BIAS, SWIGLU)
        tl.store(act_ptr + p.to(tl.int64) * I + rows, act, mask=ok)


@triton.jit
def moe_down_quant_mma_kernel(
    act_ptr, ids_ptr, rw_ptr, rows_ptr, y_ptr,   # as moe_down_quant_kernel
    parts_ptr,            # SPLIT > 1: [SPLIT, P, H] float32 out: each split's down sums
    plan_ptr, nplan_ptr, extra_slot,
    H, I, P,
    stride_row,
    codes_off, code_row_bytes, scales_off, glob_off, n_scale_cols,
    k_split,              # columns of act a split covers (a multiple of BLOCK_K)
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,    # output rows (of H) a program, >= 16
    BLOCK_K: tl.constexpr,    # columns of act a K step: BLOCK_K / GROUP >= 16 groups
    EVEN_N: tl.constexpr,     # H % BLOCK_N == 0
    EVEN_K: tl.constexpr,     # I % BLOCK_K == 0
    PLAN: tl.constexpr,
    PLAN_MAX: tl.constexpr,
    SPLIT: tl.constexpr,
    ASM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    b2_ptr=None, stride_b=0,
    BIAS: tl.constexpr = False,
):
    """Grid (P, cdiv(H, BLOCK_N), SPLIT): moe_down_quant_kernel's y (SPLIT 1: w[p] * DT(down . act[p] (+ b2)),
    exactly 0.0 for a pair with id < 0), or the split's sums into parts (y then by moe_down_from_parts_kernel)."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        rows = j * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < H
        if e >= 0:
            NG: tl.constexpr = BLOCK_K // GROUP
            row_ptr = rows_ptr + e * stride_row
            a_row = act_ptr + p.to(tl.int64) * I
            g_down = _nvfp4_global(row_ptr, glob_off, 2, FMT)
            acc = tl.zeros([NG, BLOCK_N], dtype=tl.float32)
            k_lo = s * k_split
            k_hi = tl.minimum(k_lo + k_split, I)
            k_full = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
            for k0 in range(k_lo, k_full, BLOCK_K):
                aa, ab = _block_diag(a_row, k0, I, GROUP, BLOCK_K, False, ASM)
                acc += _group_sums(aa, ab, k0, I, row_ptr, codes_off, scales_off, g_down, rows, code_row_bytes,
                                   n_scale_cols, row_ok, FMT, GROUP, BLOCK_K, EVEN_N, False, ASM)
            if not EVEN_K:
                if k_full < k_hi:
                    aa, ab = _block_diag(a_row, k_full, I, GROUP, BLOCK_K, True, ASM)
                    acc += _group_sums(aa, ab, k_full, I, row_ptr, codes_off, scales_off, g_down, rows,
                                       code_row_bytes, n_scale_cols, row_ok, FMT, GROUP, BLOCK_K, EVEN_N, True, ASM)
            d = tl.sum(acc, axis=0)
            if SPLIT == 1:
                y = _down_out(d, e, rows, H, b2_ptr, stride_b, tl.load(rw_ptr + p).to(tl.float32),
                              act_ptr.dtype.element_ty, BIAS)
                tl.store(y_ptr + p.to(tl.int64) * H + rows, y, mask=row_ok)
            else:
                tl.store(parts_ptr + (s.to(tl.int64) * P + p) * H + rows, d, mask=row_ok)
        else:
            if SPLIT == 1:
                tl.store(y_ptr + p.to(tl.int64) * H + rows, tl.zeros([BLOCK_N], dtype=tl.float32), mask=row_ok)


@triton.jit
def moe_down_from_parts_kernel(
    parts_ptr,            # [SPLIT, P, H] float32: each split's down sums
    ids_ptr, rw_ptr, y_ptr, act_ptr,   # act_ptr: only its dtype is read (the rounding of down's output)
    plan_ptr, nplan_ptr, extra_slot,
    P, H,
    BLOCK: tl.constexpr,
    PLAN: tl.constexpr,
    PLAN_MAX: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    b2_ptr=None, stride_b=0,
    BIAS: tl.constexpr = False,
):
    """Grid (P, cdiv(H, BLOCK)): y[p] from the splits' sums, added in split order, as moe_down_quant_kernel writes
    it (0.0 for a pair with id < 0; the pairs of another launch of a split call are left alone)."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        rows = j * BLOCK + tl.arange(0, BLOCK)
        ok = rows < H
        if e >= 0:
            d = route_sum(parts_ptr + p.to(tl.int64) * H, rows, ok, SPLIT, P * H)
            y = _down_out(d, e, rows, H, b2_ptr, stride_b, tl.load(rw_ptr + p).to(tl.float32),
                          act_ptr.dtype.element_ty, BIAS)
        else:
            y = tl.zeros([BLOCK], dtype=tl.float32)
        tl.store(y_ptr + p.to(tl.int64) * H + rows, y, mask=ok)
