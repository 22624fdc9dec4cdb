"""Triton kernels of the Qwen3-Next / gpt-oss decode step; `reference.py` holds the plain torch oracle of each.

Conventions as kernels/moe_decode/triton_kernels.py: plain loads / stores / reductions, no atomics; every
rounding to the storage dtype ``DT`` at the point where the torch code rounds (``_rnd``, which also rounds
bfloat16 correctly in the interpreter: EMU_BF16), fp32 between those points; ``ACCURATE`` (True on a GPU) takes
libdevice's exp / rsqrt / log1p and correctly rounded division, the functions torch's CUDA kernels call. The
launches pass enable_fp_fusion=False: no multiply-add is contracted, as in torch's separate element-wise kernels.

Legend: T tokens (one a sequence in a decode step), N a normalised width, Hk / Hv key / value heads of a Gated
DeltaNet layer, R = Hv / Hk, Dk / Dv their head dims, K the conv kernel size, D an attention head dim.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ftexpert.kernels.moe_decode.triton_kernels import _div, _exp, _rnd, _rsqrt, _sigmoid, _silu, route_sum
from ftexpert.kernels.pdl import pdl_enter


@triton.jit
def _softplus(x, ACCURATE: tl.constexpr):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)). Without libdevice, log1p(y) as
    log(u) * y / (u - 1), u = 1 + y (exact to a few ulps where log(1 + y) alone would lose y's low bits)."""
    y = _exp(x, ACCURATE)
    if ACCURATE:
        lp = libdevice.log1p(y)
    else:
        u = 1.0 + y
        lp = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _norm_factor(xf, mask, inv_n, eps, ACCURATE: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of a row (fp32; masked lanes hold 0)."""
    xf = tl.where(mask, xf, 0.0)
    return _rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps, ACCURATE)


# ---------------------------------------------------------------------------------------------------------------
# (offset + w) RMSNorm, fused with the residual add (and the shared expert's gate and combine)
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def offset_norm_kernel(
    x_ptr, sx,            # [T, N] residual stream, row stride sx
    d_ptr, sd,            # HAS_ADD: [T, N] delta (the routed output when SHARED), row stride sd
    s_ptr, ss,            # SHARED: [T, N] the shared expert's output
    h_ptr, sh,            # SHARED: [T, N] the MoE input (the gate's input)
    gw_ptr,               # SHARED: [N] the shared expert gate's weight row
    w_ptr,                # [N] norm weight
    xo_ptr, no_ptr,       # [T, N] contiguous out: x + delta (HAS_ADD), the normalised row
    N, eps, inv_n, offset,
    HAS_ADD: tl.constexpr, SHARED: tl.constexpr,
    BLOCK: tl.constexpr,  # >= N, a power of two
    ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    n_routes=1,           # PARTS: K, the routes of a token
    PARTS: tl.constexpr = False,   # delta is [T, K, N] fp32 (row stride sd, route stride N): the routed experts'
                                   # weighted per-route outputs, summed here in k order and rounded to DT
):
    """Grid (T,). [PARTS: delta = DT(((y_0 + y_1) + y_2) + ...), fp32 in k order: moe_sum_k's sum];
    [SHARED: delta = DT(delta + DT(DT(sigmoid(DT(h . gw))) * shared))]; [HAS_ADD: x = DT(x + delta), stored];
    out = DT((x * rsqrt(mean(x^2) + eps)) * (offset + w)) in fp32 (reference.offset_rms_norm)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + t * sx + offs, mask=m, other=0.0)
    DT = x.dtype
    xf = x.to(tl.float32)
    if HAS_ADD:
        if PARTS:
            d = _rnd(route_sum(d_ptr + t * sd, offs, m, n_routes, N), DT, EMU_BF16).to(tl.float32)
        else:
            d = tl.load(d_ptr + t * sd + offs, mask=m, other=0.0).to(tl.float32)
        if SHARED:
            hv = tl.load(h_ptr + t * sh + offs, mask=m, other=0.0).to(tl.float32)
            gw = tl.load(gw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            logit = _rnd(tl.sum(hv * gw, axis=0) + tl.zeros_like(hv), DT, EMU_BF16).to(tl.float32)
            gate = _rnd(_sigmoid(logit, ACCURATE), DT, EMU_BF16).to(tl.float32)
            sv = tl.load(s_ptr + t * ss + offs, mask=m, other=0.0).to(tl.float32)
            d = _rnd(d + _rnd(gate * sv, DT, EMU_BF16).to(tl.float32), DT, EMU_BF16).to(tl.float32)
        x = _rnd(xf + d, DT, EMU_BF16)
        tl.store(xo_ptr + t * N + offs, x, mask=m)
        xf = x.to(tl.float32)
    r = _norm_factor(xf, m, inv_n, eps, ACCURATE)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    out = (xf * r) * (offset + w)
    tl.store(no_ptr + t * N + offs, _rnd(out, DT, EMU_BF16), mask=m)


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet, decode: conv update + splits + gates before the recurrence; the recurrence on the state cache in
# place; RMSNormGated after it
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _conv_channels(x_src, cache_row, w_ptr, c0, n, sc, K: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
                   ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr):
    """Channels c0 .. c0+n-1 of one sequence: the new input x_src[0:n], the state cache_row[c, 0:K-1] (channel
    stride sc) and the weights w[c, 0:K] -> DT(silu(DT(sum_j w[c, j] * full[c, j]))), full = [state, x], summed in
    j order; the state is shifted by one input in place. Each lane reads its channels' state before it writes
    them, and no other lane touches them (one layout for every [BLOCK] tensor of the program)."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    c = c0 + offs
    x = tl.load(x_src + offs, mask=m, other=0.0)
    state = cache_row + c * sc
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K - 1):
        s = tl.load(state + j, mask=m, other=0.0)
        acc += tl.load(w_ptr + c * K + j, mask=m, other=0.0).to(tl.float32) * s.to(tl.float32)
        if j > 0:
            tl.store(state + (j - 1), s, mask=m)
    acc += tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0).to(tl.float32) * x.to(tl.float32)
    tl.store(state + (K - 2), x.to(cache_row.dtype.element_ty), mask=m)
    out = _rnd(acc, DT, EMU_BF16).to(tl.float32)
    return _rnd(_silu(out, ACCURATE), DT, EMU_BF16), m


@triton.jit
def gdn_pre_kernel(
    qkvz_ptr, s_qkvz,     # [T, Hk * (2Dk + 2R*Dv)] projection, row stride s_qkvz; per key head [q | k | v | z]
    ba_ptr, s_ba,         # [T, Hk * 2R] projection, row stride s_ba; per key head [b | a]
    cache_ptr, s_row, s_c,  # conv state [N, C, K-1] (last dim contiguous): row / channel strides
    rows_ptr,             # [T] int64: each sequence's row of the cache
    w_ptr,                # [C, K] conv weights, contiguous
    alog_ptr, dtb_ptr,    # [Hv] A_log, dt_bias
    q_ptr, k_ptr,         # [T, Hv, Dk] out (q / k of key head h written to value heads h*R .. h*R+R-1)
    v_ptr,                # [T, Hv, Dv] out
    g_ptr, beta_ptr,      # [T, Hv] out: g fp32, beta in DT
    Hk, Hv, Dk, Dv, R,
    K: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Grid (T, Hk): key head h of token t -- its q, k and v conv channels (channel order of the model's
    cat(q, k, v): q h*Dk + d, k Hk*Dk + h*Dk + d, v 2*Hk*Dk + h*R*Dv + i), and beta = DT(sigmoid(b)),
    g = -exp(A_log) * softplus(a + dt_bias) (fp32) of its R value heads."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    DT = q_ptr.dtype.element_ty
    group = 2 * Dk + 2 * R * Dv
    src = qkvz_ptr + t * s_qkvz + h * group
    cache_row = cache_ptr + tl.load(rows_ptr + t) * s_row
    kd = Hk * Dk
    q, mq = _conv_channels(src, cache_row, w_ptr, h * Dk, Dk, s_c, K, BLOCK_DK, DT, ACCURATE, EMU_BF16)
    k, _ = _conv_channels(src + Dk, cache_row, w_ptr, kd + h * Dk, Dk, s_c, K, BLOCK_DK, DT, ACCURATE, EMU_BF16)
    v, mv = _conv_channels(src + 2 * Dk, cache_row, w_ptr, 2 * kd + h * R * Dv, R * Dv, s_c, K, BLOCK_V, DT,
                           ACCURATE, EMU_BF16)
    dk = tl.arange(0, BLOCK_DK)
    for j in range(R):
        hv = (t * Hv + h * R + j) * Dk
        tl.store(q_ptr + hv + dk, q, mask=mq)
        tl.store(k_ptr + hv + dk, k, mask=mq)
    tl.store(v_ptr + (t * Hv + h * R) * Dv + tl.arange(0, BLOCK_V), v, mask=mv)
    jj = tl.arange(0, BLOCK_R)
    mr = jj < R
    ba = ba_ptr + t * s_ba + h * 2 * R
    b = tl.load(ba + jj, mask=mr, other=0.0).to(tl.float32)
    a = tl.load(ba + R + jj, mask=mr, other=0.0).to(tl.float32)
    heads = h * R + jj
    alog = tl.load(alog_ptr + heads, mask=mr, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + heads, mask=mr, other=0.0).to(tl.float32)
    g = -_exp(alog, ACCURATE) * _softplus(a + dtb, ACCURATE)
    tl.store(g_ptr + t * Hv + heads, g, mask=mr)
    tl.store(beta_ptr + t * Hv + heads, _rnd(_sigmoid(b, ACCURATE), DT, EMU_BF16), mask=mr)


@triton.jit
def gdn_recurrent_kernel(
    q_ptr, sq_t, sq_h,    # [T, Hqk, Dk] strides (sq_t, sq_h, 1); value head h reads q/k head h // G
    k_ptr, sk_t, sk_h,    # [T, Hqk, Dk] strides (sk_t, sk_h, 1)
    v_ptr, sv_t, sv_h,    # [T, Hv, Dv] strides (sv_t, sv_h, 1)
    g_ptr, beta_ptr,      # [T, Hv] contiguous: the log decay g (fp32) and beta
    state_ptr, s_row, s_h, s_k,  # the layer's recurrent cache [N, Hv, Dk, Dv] fp32: row / head / key strides, (.., 1)
    rows_ptr,             # [T] int64: each sequence's row of the cache (distinct)
    o_ptr,                # [T, Hv, Dv] contiguous out, in v's dtype
    Hv, Dk, Dv, G, scale, eps,
    BLOCK_K: tl.constexpr,  # >= Dk, a power of two: the whole key dim (the norms and S^T k reduce over it)
    BLOCK_V: tl.constexpr,  # the Dv tile of this program
    ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Grid (T, Hv, cdiv(Dv, BLOCK_V)): the gated delta rule's decode step (one token) of value head h of token t
    on the state slice S = state[rows[t], h, :, v-block] [Dk, BLOCK_V], read and written back in place. In fp32, in
    the order of kernels/gated_delta/reference.py: q = (q * rsqrt(sum(q^2) + eps)) * scale, k = k * rsqrt(sum(k^2)
    + eps); S = S * exp(g); delta = (v - S^T k) * beta; S = S + k delta^T; o = DT(S^T q). The programs of one
    (t, h) recompute the norms of q and k (Dk wide) and share nothing else: each loads its slice before it stores
    it, and no other program touches it (rows distinct)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // G
    dk = tl.arange(0, BLOCK_K)
    mk = dk < Dk
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = dv < Dv
    DT = o_ptr.dtype.element_ty
    q = tl.load(q_ptr + t * sq_t + hk * sq_h + dk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * sk_t + hk * sk_h + dk, mask=mk, other=0.0).to(tl.float32)
    q = q * _rsqrt(tl.sum(q * q, axis=0) + eps, ACCURATE)
    q = q * scale
    k = k * _rsqrt(tl.sum(k * k, axis=0) + eps, ACCURATE)
    v = tl.load(v_ptr + t * sv_t + h * sv_h + dv, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * Hv + h).to(tl.float32)
    beta = tl.load(beta_ptr + t * Hv + h).to(tl.float32)
    s_ptrs = state_ptr + tl.load(rows_ptr + t) * s_row + h * s_h + dk[:, None] * s_k + dv[None, :]
    m2 = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=m2, other=0.0)
    S = S * _exp(g, ACCURATE)
    recalled = tl.sum(S * k[:, None], axis=0)                           # [BLOCK_V]: S^T k
    delta = (v - recalled) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(s_ptrs, S, mask=m2)
    tl.store(o_ptr + (t * Hv + h) * Dv + dv, _rnd(o, DT, EMU_BF16), mask=mv)


@triton.jit
def gated_norm_kernel(
    o_ptr, so_t, so_h,    # [T, Hv, Dv] the recurrence's output, strides (so_t, so_h, 1)
    z_ptr, sz_t, sz_g, sz_r,  # [T, G, R, Dv] the output gate (value head hv = g * R + r), last dim contiguous
    w_ptr,                # [Dv] norm weight
    out_ptr,              # [T, Hv, Dv] contiguous out
    Hv, R, Dv, eps, inv_d,
    BLOCK_D: tl.constexpr, ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Grid (T, Hv). out = DT(DT(w * DT(x * rsqrt(mean(x^2) + eps))) * silu(z)) with silu(z) in fp32
    (reference.gated_rms_norm)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    m = d < Dv
    x = tl.load(o_ptr + t * so_t + hv * so_h + d, mask=m, other=0.0)
    DT = x.dtype
    xf = x.to(tl.float32)
    n = _rnd(xf * _norm_factor(xf, m, inv_d, eps, ACCURATE), DT, EMU_BF16).to(tl.float32)
    a = _rnd(tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * n, DT, EMU_BF16).to(tl.float32)
    z = tl.load(z_ptr + t * sz_t + (hv // R) * sz_g + (hv % R) * sz_r + d, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * Hv + hv) * Dv + d, _rnd(a * _silu(z, ACCURATE), DT, EMU_BF16), mask=m)


# ---------------------------------------------------------------------------------------------------------------
# Gated attention: (1 + w) q/k norm + partial rope (+ the KV cache write); the output gate
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _norm_partial_rope_row(src, dst, w_ptr, c_row, s_row, D, RD, eps, inv_d, offset, dst2,
                           HAS_DST2: tl.constexpr, BLOCK_D: tl.constexpr, ACCURATE: tl.constexpr,
                           EMU_BF16: tl.constexpr):
    """One head row: n = DT((x * rsqrt(mean(x^2) + eps)) * (offset + w)) in fp32; channels d < RD get
    DT(DT(n * cos) + DT(rotate_half(n) * sin)) over the first RD, the rest n (reference.apply_partial_rope)."""
    half = RD // 2
    d = tl.arange(0, BLOCK_D)
    m = d < D
    rm = d < RD
    rot = tl.where(d < half, d + half, d - half)                       # rotate_half's source (d < RD)
    x = tl.load(src + d, mask=m, other=0.0)
    DT = x.dtype
    xf = x.to(tl.float32)
    xr = tl.load(src + rot, mask=rm, other=0.0).to(tl.float32)
    r = _norm_factor(xf, m, inv_d, eps, ACCURATE)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    wr = tl.load(w_ptr + rot, mask=rm, other=0.0).to(tl.float32)
    n = _rnd((xf * r) * (offset + w), DT, EMU_BF16).to(tl.float32)
    nr = _rnd((xr * r) * (offset + wr), DT, EMU_BF16).to(tl.float32)
    nr = tl.where(d < half, -nr, nr)
    c = tl.load(c_row + d, mask=rm, other=0.0).to(tl.float32)
    s = tl.load(s_row + d, mask=rm, other=0.0).to(tl.float32)
    a = _rnd(n * c, DT, EMU_BF16).to(tl.float32)
    b = _rnd(nr * s, DT, EMU_BF16).to(tl.float32)
    out = tl.where(rm, _rnd(a + b, DT, EMU_BF16), _rnd(n, DT, EMU_BF16))
    tl.store(dst + d, out, mask=m)
    if HAS_DST2:                                                       # the KV cache row as well
        tl.store(dst2 + d, out, mask=m)


@triton.jit
def qk_norm_partial_rope_kernel(
    q_ptr, k_ptr,         # [T, HQ, D], [T, HKV, D]: strides (sqt, sqh, 1), (skt, skh, 1)
    qo_ptr, ko_ptr,       # [T, HQ, D], [T, HKV, D] contiguous out
    qw_ptr, kw_ptr,       # [D] per-head norm weights
    cos_ptr, sin_ptr,     # [T, RD] rows of stride sct / sst, in q's dtype
    HQ, HKV, D, RD,
    sqt, sqh, skt, skh, sct, sst,
    eps, inv_d, offset,
    kc_ptr, vc_ptr,       # HAS_KV: KV cache layer views [N, HKV, D] contiguous
    v_ptr, idx_ptr,       # HAS_KV: v [T, HKV, D] strides (svt, svh, 1); idx [T] int64 cache rows
    svt, svh,
    BLOCK_D: tl.constexpr, ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr,
    HAS_KV: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """Grid (T, HQ + HKV): q head h (h < HQ) or k head h - HQ of token t; with HAS_KV a k program also writes its
    row to kc[idx[t], hk] and copies v[t, hk] to vc[idx[t], hk] (moe_decode's KvWrite)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c_row = cos_ptr + t * sct
    s_row = sin_ptr + t * sst
    if h < HQ:
        _norm_partial_rope_row(q_ptr + t * sqt + h * sqh, qo_ptr + (t * HQ + h) * D, qw_ptr, c_row, s_row, D, RD,
                               eps, inv_d, offset, qo_ptr, False, BLOCK_D, ACCURATE, EMU_BF16)
    else:
        hk = h - HQ
        if HAS_KV:
            row = (tl.load(idx_ptr + t) * HKV + hk) * D
            _norm_partial_rope_row(k_ptr + t * skt + hk * skh, ko_ptr + (t * HKV + hk) * D, kw_ptr, c_row, s_row,
                                   D, RD, eps, inv_d, offset, kc_ptr + row, True, BLOCK_D, ACCURATE, EMU_BF16)
            d = tl.arange(0, BLOCK_D)
            tl.store(vc_ptr + row + d, tl.load(v_ptr + t * svt + hk * svh + d, mask=d < D), mask=d < D)
        else:
            _norm_partial_rope_row(k_ptr + t * skt + hk * skh, ko_ptr + (t * HKV + hk) * D, kw_ptr, c_row, s_row,
                                   D, RD, eps, inv_d, offset, ko_ptr, False, BLOCK_D, ACCURATE, EMU_BF16)


@triton.jit
def gated_mul_kernel(
    a_ptr, sa_t, sa_h,    # [T, H, D] the gated tensor, strides (sa_t, sa_h, 1)
    g_ptr, sg_t, sg_h,    # [T, H, D] the gate, strides (sg_t, sg_h, 1)
    out_ptr,              # [T, H, D] contiguous out
    H, D,
    SILU: tl.constexpr,   # the gate's activation: silu (the shared expert) or sigmoid (gated attention's output)
    BLOCK: tl.constexpr, ACCURATE: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Grid (T, H, cdiv(D, BLOCK)). out = DT(a * DT(act(g))), act in fp32 (torch's silu / sigmoid)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = d < D
    a = tl.load(a_ptr + t * sa_t + h * sa_h + d, mask=m, other=0.0)
    DT = a.dtype
    g = tl.load(g_ptr + t * sg_t + h * sg_h + d, mask=m, other=0.0).to(tl.float32)
    if SILU:
        act = _silu(g, ACCURATE)
    else:
        act = _sigmoid(g, ACCURATE)
    act = _rnd(act, DT, EMU_BF16).to(tl.float32)
    tl.store(out_ptr + (t * H + h) * D + d, _rnd(a.to(tl.float32) * act, DT, EMU_BF16), mask=m)
