"""Entry points of the Qwen3-Next / gpt-oss decode kernels: validation, then the Triton kernel or the torch
reference (``impl``: kernels/impl.py; "triton" on CPU tensors runs the interpreter).

Nothing here syncs with the host or depends on tensor values on the host: every function is CUDA-graph
capturable for fixed shapes (outputs are allocated per call, inside the graph's pool). `gdn_decode_pre` updates
the conv state rows it is given in place, `gdn_decode_rule` the recurrent state rows (the rows a captured graph
reads and writes: engine/state_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.kernels.gated_delta.reference import L2_EPS
from ftexpert.kernels.impl import resolve_impl
from ftexpert.kernels.moe_decode import KvWrite
from ftexpert.kernels.moe_decode.api import (_accurate, _cdiv, _check_float, _next_pow2, _row_warps,
                                            check_route_partials, emulate_bf16)
from ftexpert.kernels.next_decode import reference
from ftexpert.kernels.pdl import pdl_args

MAX_ROW = 65536          # the widest row a one-program-a-row kernel here takes
MAX_HEAD_DIM = 256       # gdn_decode_rule: the widest Dk (one program holds it whole) and Dv
DELTA_BLOCK_V = 32       # gdn_decode_rule: the default Dv tile (a [Dk, 32] fp32 slice of the state a program)


def _common(t: torch.Tensor) -> dict:
    """The launch arguments every kernel here takes."""
    return dict(ACCURATE=_accurate(t.device), EMU_BF16=emulate_bf16(t), enable_fp_fusion=False, **pdl_args(t.device))


def _check_like(name: str, t: torch.Tensor, like: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must be {list(shape)} {like.dtype} on {like.device}, got {list(t.shape)} "
                         f"{t.dtype} on {t.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with a contiguous last dimension (a view where it has one already)."""
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------------------------
# (offset + w) RMSNorm, fused residual add, shared expert gate and combine
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SharedExpert:
    """Qwen3-Next's shared expert beside the routed ones: its output `out` [T, N], the MoE input `h` [T, N] and
    the gate's weight row `gate_weight` [1, N]; the MoE output is routed + sigmoid(h . gate_weight) * out."""
    out: torch.Tensor
    h: torch.Tensor
    gate_weight: torch.Tensor


def _norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_float("x", x)
    if x.dim() != 2 or x.shape[1] > MAX_ROW:
        raise ValueError(f"x must be [T, N] with N <= {MAX_ROW}, got {tuple(x.shape)}")
    _check_like("weight", weight, x, (x.shape[1],))


def _norm_launch(x, delta, weight, eps, offset, shared: SharedExpert | None):
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.next_decode.triton_kernels import offset_norm_kernel
    T, N = x.shape
    x = _rows(x)
    x_new = torch.empty(T, N, dtype=x.dtype, device=x.device) if delta is not None else None
    normed = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return x_new, normed
    parts = delta is not None and delta.dim() == 3
    d = (delta.contiguous() if parts else _rows(delta)) if delta is not None else x
    s, h = (_rows(shared.out), _rows(shared.h)) if shared is not None else (x, x)
    gw = shared.gate_weight.reshape(N).contiguous() if shared is not None else weight
    block = _next_pow2(N)
    offset_norm_kernel[(T,)](
        x, x.stride(0), d, d.stride(0), s, s.stride(0), h, h.stride(0), gw, weight.contiguous(),
        x_new if x_new is not None else normed, normed, N, float(eps), 1.0 / N, float(offset),
        HAS_ADD=delta is not None, SHARED=shared is not None, BLOCK=block, num_warps=_row_warps(block), **_common(x),
        **(dict(n_routes=d.shape[1], PARTS=True) if parts else {}))
    return x_new, normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0,
             impl: str = "auto") -> torch.Tensor:
    """x [T, N] -> DT((offset + w) * x / rms(x)) computed in fp32, one launch: Qwen3-Next's norm (offset 1),
    gpt-oss's (offset 0). weight [N] in x's dtype."""
    _norm_args(x, weight)
    if resolve_impl(impl, x.device) == "reference":
        return reference.offset_rms_norm(x, weight, eps, offset)
    return _norm_launch(x, None, weight, eps, offset, None)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0,
                 shared: SharedExpert | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next norm, one launch: -> (x_new = x + delta, rms_norm(x_new)), [T, N] each.
    With `shared`, delta is the routed experts' output and the add takes routed + sigmoid(h . gate_weight) * out
    (the gate's dot product in fp32, rounded as its GEMV; every op rounded to x's dtype as torch rounds). delta may
    also be [T, K, N] fp32: the routed experts' weighted per-route outputs (moe_decode's `partials=True`), which the
    kernel sums in k order and rounds to x's dtype first, as moe_decode's sum launch would (one launch fewer)."""
    _norm_args(x, weight)
    if delta.dim() == 3:
        check_route_partials(x, delta)
    else:
        _check_like("delta", delta, x, x.shape)
    if shared is not None:
        _check_like("shared.out", shared.out, x, x.shape)
        _check_like("shared.h", shared.h, x, x.shape)
        _check_like("shared.gate_weight", shared.gate_weight, x, (1, x.shape[1]))
    if resolve_impl(impl, x.device) == "reference":
        parts = None if shared is None else (shared.out, shared.h, shared.gate_weight)
        return reference.add_rms_norm(x, delta, weight, eps, offset, parts)
    return _norm_launch(x, delta, weight, eps, offset, shared)


def _gated_mul(a: torch.Tensor, g: torch.Tensor, silu: bool) -> torch.Tensor:
    """a, g [T, H, D] (last dim contiguous) -> DT(a * DT(act(g))) [T, H, D] contiguous, one launch."""
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.next_decode.triton_kernels import gated_mul_kernel
    T, H, D = a.shape
    a, g = _rows(a), _rows(g)
    out = torch.empty(T, H, D, dtype=a.dtype, device=a.device)
    if out.numel():
        block = min(1024, _next_pow2(D))
        gated_mul_kernel[(T, H, _cdiv(D, block))](a, a.stride(0), a.stride(1), g, g.stride(0), g.stride(1), out, H, D,
                                                 SILU=silu, BLOCK=block, num_warps=_row_warps(block), **_common(a))
    return out


def _gated_args(name: str, a: torch.Tensor, gate: torch.Tensor, dims: int) -> None:
    _check_float(name, a)
    if a.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got {tuple(a.shape)}")
    _check_like("gate", gate, a, a.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """gate, up [T, N] -> silu(gate) * up [T, N] (each op rounded to their dtype), one launch."""
    _gated_args("up", up, gate, 2)
    if resolve_impl(impl, gate.device) == "reference":
        return reference.silu_mul(gate, up)
    return _gated_mul(up.unsqueeze(1), gate.unsqueeze(1), silu=True).squeeze(1)


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet, decode
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeltaNetHeads:
    """A Gated DeltaNet layer's head counts and sizes (Hv a multiple of Hk)."""
    Hk: int
    Hv: int
    Dk: int
    Dv: int


def gdn_decode_pre(qkvz: torch.Tensor, ba: torch.Tensor, conv_cache: torch.Tensor, rows: torch.Tensor,
                   conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, heads: DeltaNetHeads, *,
                   impl: str = "auto"):
    """A decode step of a Gated DeltaNet layer (T sequences, one token each) between its projections and the gated
    delta rule, one launch: the causal conv1d + SiLU over each sequence's conv state, which is shifted by the new
    input in place, the split into q / k / v, and the gates.

    qkvz [T, Hk*(2Dk + 2r*Dv)], ba [T, Hk*2r]: the projections (rows grouped per key head, last dim contiguous);
    conv_cache [N, C, K-1] in qkvz's dtype (a layer of the state cache, last dim contiguous), rows [T] int64 on the
    device: each sequence's row of it (distinct: not checked, that would sync); conv_weight [C, K]; A_log,
    dt_bias [Hv] (any float dtype).
    -> q, k [T, 1, Hv, Dk] (already expanded to the value heads), v [T, 1, Hv, Dv], g [T, 1, Hv] fp32,
    beta [T, 1, Hv] -- contiguous, as the gated delta rule takes them (kernels/gated_delta).
    """
    Hk, Hv, Dk, Dv = heads.Hk, heads.Hv, heads.Dk, heads.Dv
    _check_float("qkvz", qkvz)
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    r = Hv // Hk
    T = qkvz.shape[0]
    C = 2 * Hk * Dk + Hv * Dv
    if qkvz.dim() != 2 or qkvz.shape[1] != Hk * (2 * Dk + 2 * r * Dv):
        raise ValueError(f"qkvz must be [T, {Hk * (2 * Dk + 2 * r * Dv)}], got {tuple(qkvz.shape)}")
    _check_like("ba", ba, qkvz, (T, 2 * Hv))
    if conv_cache.dim() != 3 or conv_cache.shape[1] != C or conv_cache.shape[2] < 1 or conv_cache.dtype != qkvz.dtype:
        raise ValueError(f"conv_cache must be [N, {C}, K-1] in {qkvz.dtype}, got {tuple(conv_cache.shape)} "
                         f"{conv_cache.dtype}")
    K = conv_cache.shape[2] + 1
    _check_like("conv_weight", conv_weight, qkvz, (C, K))
    if rows.dtype != torch.int64 or tuple(rows.shape) != (T,):
        raise ValueError(f"rows must be int64 [{T}], got {rows.dtype} {tuple(rows.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (Hv,) or t.device != qkvz.device:
            raise ValueError(f"{name} must be [{Hv}] on {qkvz.device}, got {tuple(t.shape)} on {t.device}")
    if resolve_impl(impl, qkvz.device) == "reference":
        return reference.gdn_decode_pre(qkvz, ba, conv_cache, rows, conv_weight, A_log, dt_bias, Hk, Hv, Dk, Dv)
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.next_decode.triton_kernels import gdn_pre_kernel
    if conv_cache.stride(2) != 1:
        raise ValueError("conv_cache needs a contiguous last dimension (it is updated in place)")
    dev, dt = qkvz.device, qkvz.dtype
    q = torch.empty(T, 1, Hv, Dk, dtype=dt, device=dev)
    k = torch.empty(T, 1, Hv, Dk, dtype=dt, device=dev)
    v = torch.empty(T, 1, Hv, Dv, dtype=dt, device=dev)
    g = torch.empty(T, 1, Hv, dtype=torch.float32, device=dev)
    beta = torch.empty(T, 1, Hv, dtype=dt, device=dev)
    if T:
        qkvz, ba = _rows(qkvz), _rows(ba)
        block_v = _next_pow2(r * Dv)
        gdn_pre_kernel[(T, Hk)](
            qkvz, qkvz.stride(0), ba, ba.stride(0), conv_cache, conv_cache.stride(0), conv_cache.stride(1),
            rows.contiguous(), conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(), q, k, v, g, beta,
            Hk, Hv, Dk, Dv, r, K=K, BLOCK_DK=_next_pow2(Dk), BLOCK_V=block_v, BLOCK_R=_next_pow2(r),
            num_warps=2, **_common(qkvz))
    return q, k, v, g, beta


def gdn_decode_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, rows: torch.Tensor, *, block_v: int | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """The gated delta rule's decode step (one token a sequence) on the state cache in place, one launch: the state
    rows ``rows`` of ``state`` are read, advanced by the token and written back by the kernel itself (no gather and
    scatter of the rows around it; the reference does those: reference.gdn_decode_rule).

    q, k [T, Hqk, Dk] (gdn_decode_pre's, already expanded: Hqk = Hv; or per key head: value head h takes q/k head
    h // (Hv / Hqk)), v [T, Hv, Dv] (q, k, v one float dtype, strided views allowed, last dim contiguous); g [T, Hv]
    (the log decay, fp32 or any float dtype), beta [T, Hv] any float dtype; state [N, Hv, Dk, Dv] fp32 (a layer of
    the state cache, last dim contiguous), rows [T] int64 on the device: each sequence's row of it (distinct: not
    checked, that would sync). q and k are L2-normalised and q scaled by Dk^-0.5 here, as kernels/gated_delta does.
    -> o [T, Hv, Dv] in v's dtype, contiguous. ``block_v``: the kernel's Dv tile (a power of two; default
    DELTA_BLOCK_V, at most Dv's next power of two).
    """
    _check_float("v", v)
    if q.dim() != 3 or v.dim() != 3 or q.shape[0] != v.shape[0]:
        raise ValueError(f"q must be [T, Hqk, Dk] and v [T, Hv, Dv], got {tuple(q.shape)}, {tuple(v.shape)}")
    T, Hqk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if Hqk == 0 or Hv % Hqk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of q/k heads ({Hqk})")
    if max(Dk, Dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM}, got Dk {Dk}, Dv {Dv}")
    _check_like("q", q, v, q.shape)
    _check_like("k", k, v, q.shape)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, Hv) or not t.is_floating_point() or t.device != v.device:
            raise ValueError(f"{name} must be a float [{T}, {Hv}] on {v.device}, got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (Hv, Dk, Dv) or state.dtype != torch.float32 \
            or state.device != v.device:
        raise ValueError(f"state must be [N, {Hv}, {Dk}, {Dv}] float32 on {v.device}, got {tuple(state.shape)} "
                         f"{state.dtype} on {state.device}")
    if rows.dtype != torch.int64 or tuple(rows.shape) != (T,) or rows.device != v.device:
        raise ValueError(f"rows must be int64 [{T}] on {v.device}, got {rows.dtype} {tuple(rows.shape)} on "
                         f"{rows.device}")
    block_v = min(DELTA_BLOCK_V if block_v is None else int(block_v), _next_pow2(Dv))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if resolve_impl(impl, v.device) == "reference":
        return reference.gdn_decode_rule(q, k, v, g, beta, state, rows)
    if state.stride(3) != 1:
        raise ValueError("state needs a contiguous last dimension (it is updated in place)")
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.next_decode.triton_kernels import gdn_recurrent_kernel
    o = torch.empty(T, Hv, Dv, dtype=v.dtype, device=v.device)
    if T == 0:
        return o
    q, k, v = _rows(q), _rows(k), _rows(v)
    block_k = _next_pow2(Dk)
    gdn_recurrent_kernel[(T, Hv, _cdiv(Dv, block_v))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        g.contiguous(), beta.contiguous(), state, state.stride(0), state.stride(1), state.stride(2),
        rows.contiguous(), o, Hv, Dk, Dv, Hv // Hqk, float(Dk ** -0.5), L2_EPS,
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=_row_warps(block_k * block_v), **_common(v))
    return o


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   impl: str = "auto") -> torch.Tensor:
    """RMSNormGated after the gated delta rule, one launch: o [T, Hv, Dv], z [T, G, R, Dv] (value head g*R + r;
    a view of the qkvz projection works: last dim contiguous), weight [Dv] in o's dtype ->
    DT(DT(w * DT(norm(o))) * silu(z in fp32)) [T, Hv, Dv] contiguous."""
    _check_float("o", o)
    if o.dim() != 3 or z.dim() != 4 or z.shape[0] != o.shape[0] or z.shape[1] * z.shape[2] != o.shape[1] \
            or z.shape[3] != o.shape[2]:
        raise ValueError(f"o must be [T, Hv, Dv] and z [T, G, R, Dv] with G*R = Hv, got {tuple(o.shape)}, "
                         f"{tuple(z.shape)}")
    if z.dtype != o.dtype or z.device != o.device:
        raise ValueError(f"z ({z.dtype} on {z.device}) must match o ({o.dtype} on {o.device})")
    T, Hv, Dv = o.shape
    _check_like("weight", weight, o, (Dv,))
    if resolve_impl(impl, o.device) == "reference":
        return reference.gated_rms_norm(o, z.reshape(T, Hv, Dv), weight, eps)
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.next_decode.triton_kernels import gated_norm_kernel
    o, z = _rows(o), _rows(z)
    out = torch.empty(T, Hv, Dv, dtype=o.dtype, device=o.device)
    if T:
        block = _next_pow2(Dv)
        gated_norm_kernel[(T, Hv)](o, o.stride(0), o.stride(1), z, z.stride(0), z.stride(1), z.stride(2),
                                   weight.contiguous(), out, Hv, z.shape[2], Dv, float(eps), 1.0 / Dv, BLOCK_D=block,
                                   num_warps=_row_warps(block), **_common(o))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Gated attention
# ---------------------------------------------------------------------------------------------------------------

def qk_norm_partial_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, eps: float, *, kv: KvWrite | None = None,
                         impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's per-head (1 + w) RMSNorm of q and k, then the rotary embedding on each head's first R channels,
    one launch for both; with `kv` (moe_decode's KvWrite) the same launch writes the roped k and the given v into
    the KV cache rows kv.index (as index_copy_ of them would).

    q [T, Hq, D], k [T, Hkv, D] (strided views allowed, last dim contiguous: q may be the query half of the
    projection that carries the output gate); q_norm / k_norm [D] in q's dtype; cos / sin [T, 1, R] or [T, R] in
    q's dtype, R even and <= D. -> new contiguous q [T, Hq, D], k [T, Hkv, D] (reference.qk_norm_partial_rope).
    """
    _check_float("q", q)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, Hq, D] and [T, Hkv, D]")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    R = cos.shape[-1]
    if R % 2 or R > D or cos.numel() != T * R or sin.shape != cos.shape:
        raise ValueError(f"cos / sin must be [T, 1, R] with R even and <= {D}, got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    for name, t, shape in (("k", k, k.shape), ("q_norm", q_norm, (D,)), ("k_norm", k_norm, (D,)),
                           ("cos", cos, cos.shape), ("sin", sin, cos.shape)):
        _check_like(name, t, q, shape)
    if kv is not None:
        kv.check(k)
    if resolve_impl(impl, q.device) == "reference":
        cos3, sin3 = cos.reshape(T, 1, R), sin.reshape(T, 1, R)
        q_out, k_out = reference.qk_norm_partial_rope(q, k, q_norm, k_norm, cos3, sin3, eps)
        if kv is not None:
            kv.k_cache.index_copy_(0, kv.index, k_out)
            kv.v_cache.index_copy_(0, kv.index, kv.v)
        return q_out, k_out
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.next_decode.triton_kernels import qk_norm_partial_rope_kernel
    q, k = _rows(q), _rows(k)
    cos2, sin2 = _rows(cos.reshape(T, R)), _rows(sin.reshape(T, R))
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out, k_out
    block = _next_pow2(D)
    qk_norm_partial_rope_kernel[(T, Hq + Hkv)](
        q, k, q_out, k_out, q_norm.contiguous(), k_norm.contiguous(), cos2, sin2, Hq, Hkv, D, R,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0), sin2.stride(0), float(eps), 1.0 / D, 1.0,
        kv.k_cache if kv is not None else k_out, kv.v_cache if kv is not None else k_out,
        kv.v if kv is not None else k_out, kv.index.contiguous() if kv is not None else q_out,
        kv.v.stride(0) if kv is not None else 0, kv.v.stride(1) if kv is not None else 0,
        BLOCK_D=block, HAS_KV=kv is not None, num_warps=_row_warps(block), **_common(q))
    return q_out, k_out


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Gated attention's output gate, one launch: out [T, Hq, D] * sigmoid(gate [T, Hq, D]) -> [T, Hq * D]
    (gate may be the gate half of the q projection: last dim contiguous)."""
    _gated_args("out", out, gate, 3)
    if resolve_impl(impl, out.device) == "reference":
        return reference.sigmoid_gate(out, gate)
    return _gated_mul(out, gate, silu=False).view(out.shape[0], -1)
