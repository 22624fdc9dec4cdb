"""Triton kernels of the decode path; `reference.py` holds the plain torch oracle of each.

Only plain features: tl.load / tl.store with masks, tl.sum / tl.max / tl.min, tl.where, scalar
`if` / `else`, `range` and `tl.static_range` loops. No tl.dot (a GEMV row times a vector is an
elementwise product and a row sum, accumulated in fp32), no atomics.

Rounding: every kernel rounds to the storage dtype (``DT``, the dtype of the tensor it mirrors) at
exactly the points where the torch code it replaces rounds, by an explicit ``.to(DT)``; between two
such points it computes in fp32. ``ACCURATE`` (a constexpr, True on a real GPU) takes libdevice's
expf / rsqrtf and a correctly rounded division, i.e. the functions torch's CUDA kernels call, where
Triton's defaults are faster approximations; the Triton interpreter (CPU tests) has no libdevice,
so it runs with ACCURATE=False (numpy's exp, 1/sqrt, division).

Legend: T tokens, K routes per token, P = T*K (token, route) pairs, pair p = t*K + k, H hidden,
I expert intermediate size, S expert rows of w13 / w2 (experts, or GPU slots), E router experts,
D head dim, N normalised width.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ftexpert.kernels.pdl import pdl_enter


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _div(a, b, ACCURATE: tl.constexpr):
    # callers pass a and b of one shape (a scalar is broadcast by adding it to zeros, which leaves its
    # value unchanged): tl.math.div_rn builds its op without the broadcast of the `/` operator, and
    # not every triton version legalises mixed shapes there
    if ACCURATE:
        y = tl.math.div_rn(a, b)
    else:
        y = a / b
    return y


@triton.jit
def _sigmoid(x, ACCURATE: tl.constexpr):
    """1 / (1 + exp(-x)) in fp32 (torch's sigmoid)."""
    one = tl.zeros_like(x) + 1.0
    return _div(one, 1.0 + _exp(-x, ACCURATE), ACCURATE)


@triton.jit
def _silu(x, ACCURATE: tl.constexpr):
    """x / (1 + exp(-x)) in fp32 (torch's silu)."""
    return _div(x, 1.0 + _exp(-x, ACCURATE), ACCURATE)


@triton.jit
def _rsqrt(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        y = libdevice.rsqrt(x)
    else:
        y = tl.rsqrt(x)
    return y


@triton.jit
def _rnd(x, DT: tl.constexpr, EMU_BF16: tl.constexpr):
    """fp32 x rounded to DT (to nearest, ties to even), as a DT value. EMU_BF16 (set for bfloat16 in the Triton
    interpreter, whose conversion truncates): the rounding done on the bits, after which the conversion is exact."""
    if EMU_BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        y = b.to(tl.float32, bitcast=True).to(DT)
    else:
        y = x.to(DT)
    return y


# ----------------------------------------------------------------------------------------------
# MoE GEMV: gate/up (A), down (B), fixed-order sum over k (C)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN: tl.constexpr, PLAN_MAX: tl.constexpr):
    """Whether this launch owns route (slot) e in a split call: PLAN 0 every route; 1 the routes whose
    slot is not in the copy plan plan_ptr[:nplan_ptr[0]] (the -1 routes included); 2 only those in it.
    `extra_slot` counts as in the plan (a slot another copy fills: the split expert's; -2 for none).
    A plan longer than PLAN_MAX entries (not all compared) gives launch 2 every route: the serial order."""
    if PLAN == 0:
        own = e == e
    else:
        offs = tl.arange(0, PLAN_MAX)
        n = tl.load(nplan_ptr)
        ps = tl.load(plan_ptr + offs, mask=offs < n, other=-2).to(tl.int64)     # -2: matches no route
        in_plan = (tl.sum((ps == e).to(tl.int32), axis=0) > 0) | (n > PLAN_MAX) | (e == extra_slot)
        if PLAN == 1:
            own = in_plan == 0
        else:
            own = in_plan
    return own


@triton.jit
def _gate_up_act(gate, up, e, rows, I, b13_ptr, stride_b, alpha, limit, DT: tl.constexpr, ACCURATE: tl.constexpr,
                 BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """gate / up [BLOCK_N] fp32 dot products -> act [BLOCK_N] in DT: the biases (BIAS: b13[e], gate's then up's)
    added before gate / up are rounded to DT, then silu(gate) * up or (SWIGLU) gpt-oss's clamped SwiGLU
    (kernels/expert_reference.py apply_act), rounding after each op as torch does in DT."""
    if BIAS:
        b_row = b13_ptr + e * stride_b
        bmask = rows < I
        gate += tl.load(b_row + rows, mask=bmask, other=0.0).to(tl.float32)
        up += tl.load(b_row + I + rows, mask=bmask, other=0.0).to(tl.float32)
    gate = gate.to(DT).to(tl.float32)                                  # the bmm / linear output
    up = up.to(DT).to(tl.float32)
    if SWIGLU:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        ga = (g * alpha).to(DT).to(tl.float32)
        sig = _div(1.0, 1.0 + _exp(-ga, ACCURATE), ACCURATE).to(DT).to(tl.float32)
        glu = (g * sig).to(DT).to(tl.float32)
        act = ((u + 1.0).to(DT).to(tl.float32) * glu).to(DT)
    else:
        silu = _div(gate, 1.0 + _exp(-gate, ACCURATE), ACCURATE).to(DT).to(tl.float32)
        act = (silu * up).to(DT)
    return act


@triton.jit
def _down_out(acc, e, rows, H, b2_ptr, stride_b, rw, DT: tl.constexpr, BIAS: tl.constexpr):
    """down's dot products acc [BLOCK_N] fp32 -> rw * DT(acc + b2[e]) in fp32 (BIAS; else rw * DT(acc))."""
    if BIAS:
        acc += tl.load(b2_ptr + e * stride_b + rows, mask=rows < H, other=0.0).to(tl.float32)
    return acc.to(DT).to(tl.float32) * rw


@triton.jit
def moe_gate_up_kernel(
    x_ptr,                # [T, H] x.dtype, row stride stride_xt, columns contiguous
    ids_ptr,              # [P] int32|int64: rows of w13 (-1: pair not on the GPU)
    w13_ptr,              # [S, 2I, H]: expert stride stride_we, row stride stride_wn, columns contiguous
    act_ptr,              # [P, I] x.dtype out: silu(gate) * up
    plan_ptr, nplan_ptr,  # PLAN > 0: the copy plan's slots (int32) and its length (int32 [1])
    extra_slot,           # PLAN > 0: a slot counted as in the plan (-2: none), see _route_active
    K, H, I,
    stride_xt, stride_we, stride_wn,
    BLOCK_N: tl.constexpr,    # gate rows (and as many up rows) per program
    BLOCK_K: tl.constexpr,    # hidden columns per loop step
    EVEN_N: tl.constexpr,     # I % BLOCK_N == 0: no row masks
    EVEN_K: tl.constexpr,     # H % BLOCK_K == 0: no column masks
    ACCURATE: tl.constexpr,
    PLAN: tl.constexpr,       # 0: every route; 1: routes not in the plan; 2: routes in it (_route_active)
    PLAN_MAX: tl.constexpr,   # power of two >= the plan's largest length
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
    b13_ptr=None,             # BIAS: [S, 2I] gate then up biases, row stride stride_b
    stride_b=0,
    alpha=0.0, limit=0.0,     # SWIGLU: gpt-oss's clamped SwiGLU
    BIAS: tl.constexpr = False,
    SWIGLU: tl.constexpr = False,
):
    """Grid (P, cdiv(I, BLOCK_N)). Program (p, j): act[p, j*BLOCK_N : (j+1)*BLOCK_N].

    BIAS adds b13[id] to gate / up before they are rounded (F.linear with a bias); SWIGLU computes
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), rounding after each op as
    torch does in x.dtype (kernels/expert_reference.py apply_act), instead of silu(gate) * up.

    gate = w13[id, n] . x[t], up = w13[id, I + n] . x[t] in fp32, each rounded to x.dtype (the bmm
    output of gathered_expert_ffn); silu(gate) rounded; silu(gate) * up rounded. A pair with id < 0
    reads nothing and writes nothing (the down kernel never reads its act row). The products are
    accumulated in [BLOCK_N, BLOCK_K] fp32 and reduced once at the end (no shuffles in the loop;
    measured faster than a reduction every step, GemvBlocks).
    """
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e >= 0) & _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        DT = act_ptr.dtype.element_ty
        t = p // K
        rows = j * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N] gate rows
        cols = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        w_gate = w13_ptr + e * stride_we                               # expert's row 0
        w_up = w_gate + I * stride_wn                                  # expert's row I
        offs = rows[:, None] * stride_wn + cols[None, :]               # [BLOCK_N, BLOCK_K]
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                xv = tl.load(x_row + k0 + cols).to(tl.float32)
                if EVEN_N:
                    wg = tl.load(w_gate + k0 + offs)
                    wu = tl.load(w_up + k0 + offs)
                else:
                    rmask = rows[:, None] < I
                    wg = tl.load(w_gate + k0 + offs, mask=rmask, other=0.0)
                    wu = tl.load(w_up + k0 + offs, mask=rmask, other=0.0)
            else:
                cmask = (k0 + cols) < H
                xv = tl.load(x_row + k0 + cols, mask=cmask, other=0.0).to(tl.float32)
                m2 = (rows[:, None] < I) & cmask[None, :]
                wg = tl.load(w_gate + k0 + offs, mask=m2, other=0.0)
                wu = tl.load(w_up + k0 + offs, mask=m2, other=0.0)
            acc_g += wg.to(tl.float32) * xv[None, :]
            acc_u += wu.to(tl.float32) * xv[None, :]
        act = _gate_up_act(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), e, rows, I, b13_ptr, stride_b,
                           alpha, limit, DT, ACCURATE, BIAS, SWIGLU)
        if EVEN_N:
            tl.store(act_ptr + p.to(tl.int64) * I + rows, act)
        else:
            tl.store(act_ptr + p.to(tl.int64) * I + rows, act, mask=rows < I)


@triton.jit
def moe_down_kernel(
    act_ptr,              # [P, I] x.dtype: silu(gate) * up
    ids_ptr,              # [P] int32|int64: rows of w2 (-1: pair not on the GPU)
    rw_ptr,               # [P] routing weights (fp32, or any float dtype: read as fp32)
    w2_ptr,               # [S, H, I]: expert stride stride_we, row stride stride_wn, columns contiguous
    y_ptr,                # [P, H] fp32 out: w_k * down (down rounded to x.dtype first)
    plan_ptr, nplan_ptr,  # as in moe_gate_up_kernel
    extra_slot,           # as in moe_gate_up_kernel
    H, I,
    stride_we, stride_wn,
    BLOCK_N: tl.constexpr,    # output rows (of H) per program
    BLOCK_K: tl.constexpr,    # intermediate columns per loop step
    EVEN_N: tl.constexpr,     # H % BLOCK_N == 0
    EVEN_K: tl.constexpr,     # I % BLOCK_K == 0
    PLAN: tl.constexpr,       # as in moe_gate_up_kernel: a route this launch does not own is not written
    PLAN_MAX: tl.constexpr,
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
    b2_ptr=None,              # BIAS: [S, H] down biases, row stride stride_b (added before the rounding)
    stride_b=0,
    BIAS: tl.constexpr = False,
):
    """Grid (P, cdiv(H, BLOCK_N)). y[p, n] = float(x.dtype(w2[id, n] . act[p])) * w[p] (fp32);
    exactly 0.0 for a pair with id < 0, which reads neither weights nor its act row. Each step's
    products are reduced into [BLOCK_N] fp32 (fewer registers than a 2-D accumulator, as fast)."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if _route_active(e, plan_ptr, nplan_ptr, extra_slot, PLAN, PLAN_MAX):
        rows = j * BLOCK_N + tl.arange(0, BLOCK_N)
        y_row = y_ptr + p.to(tl.int64) * H
        if e >= 0:
            DT = act_ptr.dtype.element_ty
            cols = tl.arange(0, BLOCK_K)
            a_row = act_ptr + p.to(tl.int64) * I
            w_base = w2_ptr + e * stride_we
            offs = rows[:, None] * stride_wn + cols[None, :]               # [BLOCK_N, BLOCK_K]
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                if EVEN_K:
                    av = tl.load(a_row + k0 + cols).to(tl.float32)
                    if EVEN_N:
                        w = tl.load(w_base + k0 + offs)
                    else:
                        w = tl.load(w_base + k0 + offs, mask=rows[:, None] < H, other=0.0)
                else:
                    cmask = (k0 + cols) < I
                    av = tl.load(a_row + k0 + cols, mask=cmask, other=0.0).to(tl.float32)
                    w = tl.load(w_base + k0 + offs, mask=(rows[:, None] < H) & cmask[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * av[None, :], axis=1)
            y = _down_out(acc, e, rows, H, b2_ptr, stride_b, tl.load(rw_ptr + p).to(tl.float32), DT, BIAS)
        else:
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
        if EVEN_N:
            tl.store(y_row + rows, y)
        else:
            tl.store(y_row + rows, y, mask=rows < H)


@triton.jit
def route_sum(base, offs, m, K, stride):
    """The K weighted per-route outputs of one token at base (route k at base + k * stride, fp32), columns offs
    (mask m) -> ((y_0 + y_1) + y_2) + ... in fp32, k order: the one order moe_sum_k_kernel and the norms that take
    per-route outputs (rms_norm_kernel, next_decode's offset_norm_kernel) sum them in."""
    acc = tl.load(base + offs, mask=m, other=0.0)
    for k in range(1, K):
        acc += tl.load(base + k * stride + offs, mask=m, other=0.0)
    return acc


@triton.jit
def moe_sum_k_kernel(
    y_ptr,                # [T, K, H] fp32
    out_ptr,              # [T, H] x.dtype out
    K, H,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
):
    """Grid (T, cdiv(H, BLOCK)). out[t] = x.dtype(((y[t,0] + y[t,1]) + y[t,2]) + ...): fp32, k order."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = route_sum(y_ptr + t * K * H, offs, m, K, H)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------
# RMSNorm, fused residual add + RMSNorm
# ----------------------------------------------------------------------------------------------

@triton.jit
def rms_norm_kernel(
    x_ptr,                # [R1, R2, N] with strides (sx1, sx2, 1)
    d_ptr,                # [R1, R2, N] residual delta, strides (sd1, sd2, 1) (read when HAS_ADD)
    w_ptr,                # [N] norm weight (same dtype as x)
    xo_ptr,               # [R1*R2, N] contiguous out: x + delta (written when HAS_ADD)
    no_ptr,               # [R1*R2, N] contiguous out: the normalised rows
    R2, N,
    sx1, sx2, sd1, sd2,
    eps, inv_n,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,      # >= N, a power of two
    ACCURATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
    n_routes=1,               # PARTS: K
    PARTS: tl.constexpr = False,     # delta is [R1, K, N] fp32 (strides (sd1, N, 1); R2 = 1): the routed experts'
                                     # weighted per-route outputs, summed here as moe_sum_k_kernel sums them
):
    """Grid (R1*R2,): one row each. [PARTS: delta = DT(((y_0 + y_1) + y_2) + ...), fp32 in k order];
    [x_new = DT(x + delta)]; r = rsqrt(mean(x^2) + eps) in fp32; out = DT(w * DT(x * r)) -- layers.rms_norm's
    rounding points."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    i1 = row // R2
    i2 = row % R2
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + i1 * sx1 + i2 * sx2 + offs, mask=m, other=0.0)
    DT = x.dtype
    if HAS_ADD:
        if PARTS:
            d = route_sum(d_ptr + i1 * sd1, offs, m, n_routes, N).to(DT)
        else:
            d = tl.load(d_ptr + i1 * sd1 + i2 * sd2 + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(DT)
        tl.store(xo_ptr + row * N + offs, x, mask=m)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=0) * inv_n
    r = _rsqrt(ms + eps, ACCURATE)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    out = w * (xf * r).to(DT).to(tl.float32)
    tl.store(no_ptr + row * N + offs, out.to(no_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------------------
# qwen3 q/k norm per head + rotary embedding (or the rotary embedding alone)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _norm_rope_row(src, dst, w_ptr, c_row, s_row, D, eps, inv_d,
                   HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, ACCURATE: tl.constexpr, dst2,
                   HAS_DST2: tl.constexpr):
    """One head row of D: [n = DT(w * DT(x * rsqrt(mean(x^2) + eps)))], then
    DT(DT(n * cos) + DT(rotate_half(n) * sin)) -- rms_norm then layers.apply_rope, rounding alike."""
    half = D // 2
    d = tl.arange(0, BLOCK_D)
    m = d < D
    rot = tl.where(d < half, d + half, d - half)                      # rotate_half's source index
    x = tl.load(src + d, mask=m, other=0.0)
    DT = x.dtype
    xf = x.to(tl.float32)
    xr = tl.load(src + rot, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        ms = tl.sum(xf * xf, axis=0) * inv_d
        r = _rsqrt(ms + eps, ACCURATE)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + rot, mask=m, other=0.0).to(tl.float32)
        xf = (w * (xf * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        xr = (wr * (xr * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    xr = tl.where(d < half, -xr, xr)
    c = tl.load(c_row + d, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_row + d, mask=m, other=0.0).to(tl.float32)
    a = (xf * c).to(DT).to(tl.float32)
    b = (xr * s).to(DT).to(tl.float32)
    tl.store(dst + d, (a + b).to(DT), mask=m)
    if HAS_DST2:                                                      # the KV cache row as well
        tl.store(dst2 + d, (a + b).to(DT), mask=m)


@triton.jit
def qk_norm_rope_kernel(
    q_ptr, k_ptr,         # [T, HQ, D], [T, HKV, D]: strides (sqt, sqh, 1), (skt, skh, 1)
    qo_ptr, ko_ptr,       # [T, HQ, D], [T, HKV, D] contiguous out
    qw_ptr, kw_ptr,       # [D] per-head norm weights (read when HAS_NORM)
    cos_ptr, sin_ptr,     # [T, D] rows of stride sct / sst, in q's dtype
    HQ, HKV, D,
    sqt, sqh, skt, skh, sct, sst,
    eps, inv_d,
    kc_ptr, vc_ptr,       # HAS_KV: KV cache layer views [N, HKV, D] contiguous (rows: slot * S + position)
    v_ptr, idx_ptr,       # HAS_KV: v [T, HKV, D] strides (svt, svh, 1); idx [T] int64 cache rows
    svt, svh,
    HAS_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,    # >= D, a power of two
    ACCURATE: tl.constexpr,
    HAS_KV: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
):
    """Grid (T, HQ + HKV): program (t, h) handles q head h (h < HQ) or k head h - HQ of token t; with
    HAS_KV, a k program also writes its result to kc[idx[t], hk] and copies v[t, hk] to vc[idx[t], hk]
    (the decode step's KV cache write, which an index_copy per tensor did)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c_row = cos_ptr + t * sct
    s_row = sin_ptr + t * sst
    if h < HQ:
        _norm_rope_row(q_ptr + t * sqt + h * sqh, qo_ptr + (t * HQ + h) * D, qw_ptr, c_row, s_row,
                       D, eps, inv_d, HAS_NORM, BLOCK_D, ACCURATE, qo_ptr, False)
    else:
        hk = h - HQ
        if HAS_KV:
            row = (tl.load(idx_ptr + t) * HKV + hk) * D
            _norm_rope_row(k_ptr + t * skt + hk * skh, ko_ptr + (t * HKV + hk) * D, kw_ptr, c_row, s_row,
                           D, eps, inv_d, HAS_NORM, BLOCK_D, ACCURATE, kc_ptr + row, True)
            d = tl.arange(0, BLOCK_D)
            tl.store(vc_ptr + row + d, tl.load(v_ptr + t * svt + hk * svh + d, mask=d < D), mask=d < D)
        else:
            _norm_rope_row(k_ptr + t * skt + hk * skh, ko_ptr + (t * HKV + hk) * D, kw_ptr, c_row, s_row,
                           D, eps, inv_d, HAS_NORM, BLOCK_D, ACCURATE, ko_ptr, False)


# ----------------------------------------------------------------------------------------------
# Router: softmax, top-k, renormalise (qwen3 / olmoe) or top-k, softmax (mixtral)
# ----------------------------------------------------------------------------------------------

@triton.jit
def route_topk_kernel(
    logits_ptr,           # [T, E] router logits (any float dtype), row stride stride_t
    ids_ptr,              # [T, K] int64 out, in descending order of the selected value
    w_ptr,                # [T, K] fp32 out
    E, stride_t,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,    # >= E, a power of two
    BLOCK_K: tl.constexpr,    # >= K, a power of two
    SOFTMAX_FIRST: tl.constexpr,   # qwen3 / olmoe: softmax over E, then top-k; mixtral: top-k, softmax
    RENORM: tl.constexpr,          # divide the top-k probabilities by their sum (norm_topk_prob)
    ACCURATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,   # launched with PDL: wait for the kernel before first (kernels/pdl.py)
    ROUND: tl.constexpr = False,     # the weights rounded to the logits' dtype (then stored as fp32)
    EMU_BF16: tl.constexpr = False,  # see _rnd
):
    """Grid (T,). Ties pick the lowest expert id; ids are clamped to [0, E) (NaN logits)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    v = tl.load(logits_ptr + t * stride_t + offs, mask=m, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        mx = tl.max(v, axis=0)
        ex = tl.where(m, _exp(v - mx, ACCURATE), 0.0)
        v = _div(ex, tl.zeros_like(ex) + tl.sum(ex, axis=0), ACCURATE)
        v = tl.where(m, v, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(v, axis=0)
        idx = tl.min(tl.where(v == best, offs, BLOCK_E), axis=0)
        idx = tl.minimum(idx, E - 1)
        tl.store(ids_ptr + t * K + k, idx.to(tl.int64))
        top = tl.where(kk == k, best, top)
        v = tl.where(offs == idx, float("-inf"), v)
    km = kk < K
    if SOFTMAX_FIRST:
        if RENORM:
            top = _div(top, tl.zeros_like(top) + tl.sum(tl.where(km, top, 0.0), axis=0), ACCURATE)
    else:
        mx = tl.max(tl.where(km, top, float("-inf")), axis=0)
        ex = tl.where(km, _exp(top - mx, ACCURATE), 0.0)
        top = _div(ex, tl.zeros_like(ex) + tl.sum(ex, axis=0), ACCURATE)
    if ROUND:
        top = _rnd(top, logits_ptr.dtype.element_ty, EMU_BF16).to(tl.float32)
    tl.store(w_ptr + t * K + kk, top, mask=km)
