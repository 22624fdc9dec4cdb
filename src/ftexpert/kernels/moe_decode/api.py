"""Entry points of the decode kernels: validation, then the Triton kernel or the torch reference.

`impl="auto"` runs the Triton kernel on CUDA tensors and the reference elsewhere; `"triton"` on CPU
tensors needs TRITON_INTERPRET=1 set before this package's kernels are first used (the Triton
interpreter; tests/conftest.py sets it); `"reference"` always runs the torch code.

Nothing here syncs with the host or depends on tensor values on the host: every function is
CUDA-graph capturable for fixed shapes (outputs are allocated per call, inside the graph's pool).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ftexpert.kernels.impl import IMPLS, interpreted, resolve_impl as _resolve_impl  # noqa: F401 (IMPLS re-exported)
from ftexpert.kernels.pdl import pdl_args

from ftexpert.kernels.moe_decode import reference



GEMV_WARPS = 4     # warps of each of moe_gemv's launches


@dataclass(frozen=True)
class GemvBlocks:
    """Block sizes of `moe_gemv`'s kernels. Results do not depend on these except through the order
    of fp32 summation inside a dot product; the tests take small ones, so that tiny shapes still run
    several blocks and ragged edges. Defaults picked on the H200
    (`python bench/bench_moe_decode.py --tokens 1 --active 8,2 --sweep`, docs/BENCHMARKS.md): gate/up
    4 x 512 with its 2-D accumulator took a call from 34.7 to 28.1 us with all 8 routes on the GPU and
    from 28.5 to 15.6 us with 2 (an offload layer's launch after its copy); the down variants were within
    noise, so down keeps the per-step reduction (fewer registers).

    gate/up kernel, grid (P, I / gate_up_block_n): each program streams 2 * gate_up_block_n rows of
    H weights (qwen3-30b-a3b: 32 rows * 2048 * 2 B = 128 KiB) in gate_up_block_k-column steps.
    down kernel, grid (P, H / down_block_n): down_block_n rows of I weights each.
    Registers (ptxas for sm_90 through triton 3.9 on a CPU machine, bf16, aligned, 4 warps): gate/up
    4x512: 72; down 16x256: 48; no spills. With every program resident, the bytes in flight per loop
    step are P * rows * block_k * 2 (T=1: ~6 MB for gate/up), whatever block_n is; block_n sets how
    evenly the programs spread over the SMs.

    quant_group_sum (moe_gemv_quant's 4-bit formats only): each group's products summed before its scale is
    applied, one multiply a group instead of two a weight (the decode of a 4-bit weight is ~6 instructions
    beside its one multiply-add; these kernels are not bound by HBM: docs/QUANTIZATION.md).
    Results differ from the plain order by rounding (nvfp4's scale is not a power of two). The default of mxfp4
    and nvfp4 (QUANT_GEMV_BLOCKS), where the sweep measured it; int4 keeps it off until measured.

    quant_mma (moe_gemv_quant, mxfp4 and nvfp4 only): the gate/up GEMV on the tensor cores
    (quant_mma_kernels.py: weights decoded to bfloat16 two an instruction, the group sums as a dot with the
    block-diagonal activations); gate_up_block_n >= 16 rows and gate_up_block_k / group >= 16 groups, over
    mma_split column ranges (0: the fewest, a power of two, that give 512 programs or more; each split's sums are
    added in order by a second launch), mma_warps warps a program; quant_mma_down the same for down
    (down_block_n >= 16, down_block_k >= 16 groups). Off until timed on the GPU (docs/QUANTIZATION.md).
    """
    gate_up_block_n: int = 4
    gate_up_block_k: int = 512
    down_block_n: int = 16
    down_block_k: int = 256
    sum_block: int = 1024
    quant_group_sum: bool = False     # moe_gemv_quant, 4-bit formats: a scale a group's sum, not a weight (GSUM)
    quant_mma: bool = False           # moe_gemv_quant, mxfp4 / nvfp4: gate/up on the tensor cores
    quant_mma_down: bool = False      # ... and down (down_block_n, down_block_k)
    mma_split: int = 0                # quant_mma: column ranges of gate/up (0: auto)
    mma_warps: int = 8                # quant_mma: warps of a gate/up program


DEFAULT_GEMV_BLOCKS = GemvBlocks()
# moe_gemv_quant's blocks by format where they differ from DEFAULT_GEMV_BLOCKS: the `tuning` suite's sweep on the
# H100 (`bench_moe_decode_quant.py --sweep`, docs/QUANTIZATION.md) took gpt-oss-120b's MXFP4 pair from 46.6 to 38.4 us
# a layer and qwen3-next's NVFP4 pair from 21.4 to 18.3 us with gate/up 8 x 512, down 8 x 256 and the scale a
# group's sum. The other group-sum variants: 40.3-41.6 us (MXFP4), 18.2-19.7 (NVFP4; 18.2 with gate/up 4 x 512, within
# the sweep's spread); the best without the group sum: 45.6 and 20.4.
QUANT_GEMV_BLOCKS = {name: GemvBlocks(gate_up_block_n=8, gate_up_block_k=512, down_block_n=8, down_block_k=256,
                                      quant_group_sum=True) for name in ("mxfp4", "nvfp4")}


@dataclass(frozen=True)
class CopyPlan:
    """The slots a copy running beside `moe_gemv` fills (the slot cache's plan, left on the device):
    `slots[:length[0]]`, int32, with `length` an int32 tensor of one element and `max_len` a bound on
    it known on the host (the copy's own `max_copies`); `extra_slot` >= 0: one more slot that copy fills
    (the hybrid backend's split slot, kernels/expert_split)."""
    slots: torch.Tensor
    length: torch.Tensor
    max_len: int
    extra_slot: int = -1

    def check(self, device: torch.device) -> None:
        for name, t in (("slots", self.slots), ("length", self.length)):
            if t.dtype != torch.int32 or t.device != device:
                raise ValueError(f"CopyPlan.{name} must be int32 on {device}, got {t.dtype} on {t.device}")
        if self.slots.dim() != 1 or not self.slots.is_contiguous():
            raise ValueError(f"CopyPlan.slots must be a contiguous 1-D tensor, got shape "
                             f"{tuple(self.slots.shape)} with strides {self.slots.stride()}")
        if self.length.numel() < 1 or self.max_len < 0 or self.max_len > self.slots.numel():
            raise ValueError(f"CopyPlan: max_len {self.max_len} must be in [0, {self.slots.numel()}] "
                             f"and length a one-element tensor")


@dataclass(frozen=True)
class KvWrite:
    """Where `qk_norm_rope` also writes a decode step's keys and values (the KV cache write fused into
    it): rows `index[t]` of the layer's cache views `k_cache` / `v_cache` [N, Hkv, D] (contiguous,
    `KVCache.flat`) get the roped k[t] and `v[t]` [T, Hkv, D] (last dimension contiguous). `index` is
    int64 [T] (any stride), distinct rows in [0, N): not checked, since that would sync with the host,
    and unlike index_copy_ (a device-side assert) a row outside [0, N) is an out-of-bounds store."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    index: torch.Tensor
    v: torch.Tensor

    def check(self, k: torch.Tensor) -> None:
        T, Hkv, D = k.shape
        for name, t in (("k_cache", self.k_cache), ("v_cache", self.v_cache)):
            if t.dim() != 3 or tuple(t.shape[1:]) != (Hkv, D) or t.dtype != k.dtype or not t.is_contiguous():
                raise ValueError(f"KvWrite.{name} must be a contiguous [N, {Hkv}, {D}] {k.dtype} tensor, got "
                                 f"{tuple(t.shape)} {t.dtype}")
        if self.k_cache.shape != self.v_cache.shape:
            raise ValueError(f"KvWrite: k_cache {tuple(self.k_cache.shape)} and v_cache "
                             f"{tuple(self.v_cache.shape)} differ")
        if tuple(self.v.shape) != (T, Hkv, D) or self.v.dtype != k.dtype or self.v.stride(2) != 1:
            raise ValueError(f"KvWrite.v must be [{T}, {Hkv}, {D}] {k.dtype} with a contiguous last dimension, "
                             f"got {tuple(self.v.shape)} {self.v.dtype}")
        if self.index.dtype != torch.int64 or tuple(self.index.shape) != (T,):
            raise ValueError(f"KvWrite.index must be int64 [{T}], got {self.index.dtype} {tuple(self.index.shape)}")
        for name, t in (("k_cache", self.k_cache), ("v_cache", self.v_cache), ("v", self.v), ("index", self.index)):
            if t.device != k.device:
                raise ValueError(f"KvWrite.{name} is on {t.device}, k on {k.device}")


def _accurate(device: torch.device) -> bool:
    """libdevice expf / rsqrtf and IEEE division in the kernels: on a GPU, not in the interpreter
    (which has no libdevice)."""
    return device.type == "cuda" and not interpreted()


def emulate_bf16(t: torch.Tensor) -> bool:
    """The kernels' EMU_BF16 (triton_kernels._rnd): bfloat16 rounding by hand, in the interpreter only."""
    return t.dtype == torch.bfloat16 and interpreted()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _row_warps(block: int) -> int:
    if block <= 256:
        return 1
    if block <= 1024:
        return 2
    if block <= 4096:
        return 4
    return 8


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


# ----------------------------------------------------------------------------------------------
# MoE GEMV
# ----------------------------------------------------------------------------------------------

def check_bias_args(x: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None, act, slots: int,
                    two_i: int, hidden: int) -> tuple[bool, float, float]:
    """Validate moe_gemv's / moe_gemv_quant's b13 [S, 2I], b2 [S, H] (both or neither, x.dtype, contiguous last
    dimension) and act -> (clamped SwiGLU?, alpha, limit)."""
    if (b13 is None) != (b2 is None):
        raise ValueError("moe_gemv: give both biases (b13 [S, 2I], b2 [S, H]) or neither")
    if b13 is not None and (b13.shape != (slots, two_i) or b2.shape != (slots, hidden) or b13.dtype != x.dtype
                            or b2.dtype != x.dtype or b13.stride(1) != 1 or b2.stride(1) != 1
                            or b13.device != x.device or b2.device != x.device):
        raise ValueError(f"moe_gemv: b13 {tuple(b13.shape)} / b2 {tuple(b2.shape)} must be [S, 2I] / [S, H] = "
                         f"[{slots}, {two_i}] / [{slots}, {hidden}] in {x.dtype} on {x.device} with a contiguous "
                         f"last dimension")
    swiglu = act is not None and act.name == "swiglu-clamp"
    if act is not None and not swiglu and act.name != "silu":
        raise ValueError(f"moe_gemv: activation {act.label} has no kernel")
    return swiglu, (float(act.alpha) if swiglu else 0.0), (float(act.limit) if swiglu else 0.0)


def moe_gemv(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, *, impl: str = "auto", blocks: GemvBlocks | None = None,
             plan: CopyPlan | None = None, between: Callable[[], None] | None = None,
             between_down: Callable[[], None] | None = None, b13: torch.Tensor | None = None,
             b2: torch.Tensor | None = None, act=None, partials: bool = False) -> torch.Tensor:
    """MoE FFN of a decode batch, reading the routed experts in place: -> [T, H] in x.dtype.

        y[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),   e = ids[t, k]

    x: [T, H] float32 | bfloat16 | float16 (rows of stride x.stride(0), columns contiguous).
    ids: [T, K] int32 | int64: rows of w13 / w2 (experts, or GPU slots); -1: the route is not on
        the GPU and adds exactly 0 (neither its weights nor its routing weight are read). Values are
        not checked (that would sync with the host): an id >= S reads out of bounds.
    weights: [T, K] routing weights (float32; other float dtypes are read as float32).
    w13: [S, 2I, H] gate rows 0..I-1, up rows I..2I-1; w2: [S, H, I]; both in x.dtype with
        contiguous last dimension (any expert / row stride: views into a packed [S, N] layer work).
    Rounding as gathered_expert_ffn: gate/up in x.dtype, silu in x.dtype, act in x.dtype, down in
    x.dtype, times weight in fp32, summed over k in fp32 in k order (0, 1, ...), cast to x.dtype.
    Deterministic, no atomics. Three launches: gate/up -> act [P, I]; down -> y [P, H] fp32; sum.

    Split around a copy (`plan`, a `CopyPlan` of the slots a concurrent copy is filling): gate/up and
    down run first for the routes whose slot is not in the plan, then `between()` is called (the
    caller makes the stream wait for the copy there), then gate/up and down for the routes in the
    plan, then the sum: five launches, the same arithmetic, so the result is bit-identical to the
    unsplit call. The routes outside the plan never read a slot the copy writes.
    Biased experts (gpt-oss): b13 [S, 2I] and b2 [S, H] in x.dtype (contiguous last dimension, any row stride:
    views of the rows' bias tails work), added before gate/up's and down's rounding; act: a
    proto.expert_act.ExpertAct (None: silu; swiglu-clamp: gpt-oss's clamped SwiGLU).
    `between_down()`, when given, is called after the plan's gate/up launch and before its down launch:
    a copy in two parts (w13, then w2) waits for its first part in `between()` and for the second one
    there, so the fetched routes' gate/up runs while their w2 is still on the way. Without a split (no
    plan, a reference run, nothing to compute) both hooks run before any launch.
    """
    _check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids must be [T, K] with T = {x.shape[0]}, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must have the shape of ids {tuple(ids.shape)}")
    T, H = x.shape
    K = ids.shape[1]
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[2] != H or w2.shape[1] != H \
            or w13.shape[1] != 2 * w2.shape[2] or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [S, 2I, H] and "
                         f"[S, H, I] with H = {H}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"w13 / w2 ({w13.dtype} / {w2.dtype}) must have x's dtype {x.dtype}")
    for name, t in (("x", x), ("ids", ids), ("weights", weights)):
        if t.device != w13.device or w2.device != w13.device:
            raise ValueError(f"{name} is on {t.device}, the experts on {w13.device} / {w2.device}")
    if plan is not None:
        plan.check(w13.device)
        if between is None:
            raise ValueError("moe_gemv with a CopyPlan needs between(): the wait for the copy that fills "
                             "the plan's slots (without it the second launch would not wait)")
    if between_down is not None and between is None:
        raise ValueError("moe_gemv: between_down() is the second half of a two-part wait; give between() too")
    swiglu, alpha, limit = check_bias_args(x, b13, b2, act, w13.shape[0], w13.shape[1], H)
    impl = _resolve_impl(impl, x.device)
    split = plan is not None and impl != "reference" and T > 0 and K > 0
    if not split and between is not None:
        between()                       # no launch before it: waiting first keeps every read after the copy
        if between_down is not None:
            between_down()
    if impl == "reference":
        return reference.moe_gemv_reference(x, ids, weights, w13, w2, b13, b2, act if swiglu else None, partials)
    if T == 0 or K == 0:
        return torch.zeros(T, K, H, device=x.device) if partials else torch.zeros_like(x)
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("w13 and w2 need a contiguous last dimension")
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.moe_decode.triton_kernels import moe_down_kernel, moe_gate_up_kernel, moe_sum_k_kernel
    b = blocks or DEFAULT_GEMV_BLOCKS
    inter = w2.shape[2]
    P = T * K
    if x.stride(1) != 1:
        x = x.contiguous()
    ids_flat = ids.contiguous().view(-1)                              # [P]
    rw_flat = weights.contiguous().view(-1)                           # [P]
    accurate = _accurate(x.device)
    pdl = pdl_args(x.device)
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)       # [P, I]
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)       # [P, H] fp32
    if not split:
        parts, plan_args, plan_max = (0,), (ids_flat, ids_flat, -2), 1    # (the pointers are not read)
    else:
        extra = plan.extra_slot if plan.extra_slot >= 0 else -2
        parts, plan_args, plan_max = (1, 2), (plan.slots, plan.length, extra), _next_pow2(max(1, plan.max_len))
    for part in parts:
        if part == 2 and between is not None:
            between()                   # the copy's slots are read only after this
        moe_gate_up_kernel[(P, _cdiv(inter, b.gate_up_block_n))](
            x, ids_flat, w13, act, *plan_args, K, H, inter, x.stride(0), w13.stride(0), w13.stride(1),
            BLOCK_N=b.gate_up_block_n, BLOCK_K=b.gate_up_block_k,
            EVEN_N=inter % b.gate_up_block_n == 0, EVEN_K=H % b.gate_up_block_k == 0,
            ACCURATE=accurate, PLAN=part, PLAN_MAX=plan_max, num_warps=GEMV_WARPS,
            b13_ptr=x if b13 is None else b13, stride_b=b13.stride(0) if b13 is not None else 0,
            alpha=alpha, limit=limit,
            BIAS=b13 is not None, SWIGLU=swiglu, **pdl)
        if part == 2 and between_down is not None:
            between_down()              # the plan's w2 rows are read only after this
        moe_down_kernel[(P, _cdiv(H, b.down_block_n))](
            act, ids_flat, rw_flat, w2, y, *plan_args, H, inter, w2.stride(0), w2.stride(1),
            BLOCK_N=b.down_block_n, BLOCK_K=b.down_block_k,
            EVEN_N=H % b.down_block_n == 0, EVEN_K=inter % b.down_block_k == 0,
            PLAN=part, PLAN_MAX=plan_max, num_warps=GEMV_WARPS,
            b2_ptr=y if b2 is None else b2, stride_b=b2.stride(0) if b2 is not None else 0, BIAS=b2 is not None, **pdl)
    if partials:                                                      # the caller sums them (k order)
        return y.view(T, K, H)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)           # [T, H]
    moe_sum_k_kernel[(T, _cdiv(H, b.sum_block))](y, out, K, H, BLOCK=b.sum_block, num_warps=GEMV_WARPS, **pdl)
    return out


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------

def _rows3(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int, int, int]:
    """View t [..., N] as [R1, R2, N] with strides (s1, s2, 1) without copying where possible."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 1, 0, 0
    if t.dim() == 2:
        return t, t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t, t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    t = t.reshape(-1, n)
    return t, t.shape[0], 1, t.stride(0), 0


def _norm_launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.moe_decode.triton_kernels import rms_norm_kernel
    n = x.shape[-1]
    xv, r1, r2, sx1, sx2 = _rows3(x, n)
    parts = delta is not None and delta.dim() == x.dim() + 1
    if parts:                                   # [T, K, N] fp32 per-route outputs: one row of x each T
        dv, sd1, sd2 = delta.contiguous(), delta.shape[1] * n, 0
        x_new = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif delta is not None:
        dv, _, _, sd1, sd2 = _rows3(delta, n)
        x_new = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        dv, sd1, sd2, x_new = xv, 0, 0, None
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = r1 * r2
    if rows == 0 or n == 0:
        if parts:
            delta = reference.sum_routes(delta, x.dtype)
        return (None if delta is None else x + delta), normed
    block = _next_pow2(n)
    weight = weight.contiguous()
    rms_norm_kernel[(rows,)](
        xv, dv, weight, x_new if x_new is not None else normed, normed, r2, n, sx1, sx2, sd1, sd2,
        float(eps), 1.0 / n, HAS_ADD=delta is not None, BLOCK=block,
        ACCURATE=_accurate(x.device), num_warps=_row_warps(block), **pdl_args(x.device),
        **(dict(n_routes=delta.shape[1], PARTS=True) if parts else {}))
    return x_new, normed


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_float("x", x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N] with N = x.shape[-1] = {x.shape[-1]}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal x's {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if x.shape[-1] > 65536:
        raise ValueError(f"rms_norm normalises rows of at most 65536 elements, got {x.shape[-1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension, one launch: x [..., N], weight [N] -> [..., N] (contiguous).

    Numerics of gpu_worker/models/layers.py:rms_norm: fp32 statistics, x * rsqrt(mean(x^2) + eps)
    cast to x.dtype, times weight in x.dtype. Per-head use (qwen3 q/k norm): x [T, heads, D] with
    weight [D]; x may be a strided view such as a slice of a fused qkv projection.
    """
    _check_norm(x, weight)
    if _resolve_impl(impl, x.device) == "reference":
        return reference.rms_norm_reference(x, weight, eps)
    return _norm_launch(x, None, weight, eps)[1]


def check_route_partials(x: torch.Tensor, delta: torch.Tensor) -> None:
    """delta must be the per-route outputs of x's rows: [T, K >= 1, N] float32 on x's device, x [T, N]."""
    if delta.dtype != torch.float32 or delta.shape[0] != x.shape[0] or delta.shape[2] != x.shape[1] \
            or delta.shape[1] < 1 or delta.device != x.device:
        raise ValueError(f"delta as per-route outputs must be [{x.shape[0]}, K >= 1, {x.shape[1]}] float32 on "
                         f"{x.device}, got {list(delta.shape)} {delta.dtype} on {delta.device}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next RMSNorm, one launch: -> (x_new, normed), both [..., N].

    x_new = x + delta in x.dtype (torch's rounding of the add); normed = rms_norm(x_new, weight, eps).
    x [T, N] with delta [T, K, N] float32: the routed experts' weighted per-route outputs (moe_gemv's `partials`),
    summed in k order and rounded to x.dtype first, as moe_gemv's sum launch does (one launch fewer).
    """
    _check_norm(x, weight)
    if x.dim() == 2 and delta.dim() == 3:
        check_route_partials(x, delta)
    elif delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if _resolve_impl(impl, x.device) == "reference":
        return reference.add_rms_norm_reference(x, delta, weight, eps)
    return _norm_launch(x, delta, weight, eps)


# ----------------------------------------------------------------------------------------------
# q/k norm + rope
# ----------------------------------------------------------------------------------------------

def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 0.0, *,
                 impl: str = "auto", kv: KvWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qwen3's per-head RMSNorm of q and k, then the rotary embedding, one launch for both.
    With `kv` (a `KvWrite`), the same launch also writes the roped k and the given v into the KV cache
    rows `kv.index` (bit-identical to index_copy_ of the returned k and of v).

    q [T, Hq, D], k [T, Hkv, D] (strided views allowed, last dimension contiguous); q_norm / k_norm
    [D] in q's dtype, or both None for the rotary embedding alone (mixtral; olmoe after its norm
    over the whole projection); cos / sin [T, 1, D] or [T, D] already in q's dtype (RotaryTable).
    Returns new contiguous (q [T, Hq, D], k [T, Hkv, D]) with the numerics of
    layers.apply_rope(layers.rms_norm(x, w, eps), cos, sin): x * cos + rotate_half(x) * sin, each
    product rounded to x.dtype, then the sum.
    """
    _check_float("q", q)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, Hq, D] and [T, Hkv, D]")
    if k.dtype != q.dtype:
        raise TypeError(f"k dtype {k.dtype} must equal q's {q.dtype}")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if D % 2:
        raise ValueError(f"head dim {D} must be even for the rotary embedding")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (D,) or w.dtype != q.dtype):
            raise ValueError(f"{name} must be [{D}] in {q.dtype}, got {tuple(w.shape)} {w.dtype}")
    cos2, sin2 = cos.reshape(T, D), sin.reshape(T, D)
    if cos2.dtype != q.dtype or sin2.dtype != q.dtype:
        raise TypeError(f"cos / sin must already be in q's dtype {q.dtype} (RotaryTable.lookup does that)")
    if kv is not None:
        kv.check(k)
    if _resolve_impl(impl, q.device) == "reference":
        q_out, k_out = reference.qk_norm_rope_reference(q, k, q_norm, k_norm, cos, sin, eps)
        if kv is not None:
            kv.k_cache.index_copy_(0, kv.index, k_out)
            kv.v_cache.index_copy_(0, kv.index, kv.v)
        return q_out, k_out
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.moe_decode.triton_kernels import qk_norm_rope_kernel
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if cos2.stride(1) != 1:
        cos2 = cos2.contiguous()
    if sin2.stride(1) != 1:
        sin2 = sin2.contiguous()
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, D, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    has_norm = q_norm is not None
    if has_norm:
        q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()
    block = _next_pow2(D)
    qk_norm_rope_kernel[(T, Hq + Hkv)](
        q, k, q_out, k_out, q_norm if has_norm else q, k_norm if has_norm else k, cos2, sin2,
        Hq, Hkv, D, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0), sin2.stride(0),
        float(eps), 1.0 / D,
        kv.k_cache if kv is not None else k_out, kv.v_cache if kv is not None else k_out,
        kv.v if kv is not None else k_out, kv.index.contiguous() if kv is not None else q_norm if has_norm else q,
        kv.v.stride(0) if kv is not None else 0, kv.v.stride(1) if kv is not None else 0,
        HAS_NORM=has_norm, BLOCK_D=block, ACCURATE=_accurate(q.device), HAS_KV=kv is not None,
        num_warps=_row_warps(block), enable_fp_fusion=False,   # x*cos + r*sin: no FMA, as torch
        **pdl_args(q.device))
    return q_out, k_out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         impl: str = "auto", kv: KvWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of q [T, Hq, D] and k [T, Hkv, D] alone, one launch (see qk_norm_rope)."""
    return qk_norm_rope(q, k, None, None, cos, sin, 0.0, impl=impl, kv=kv)


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------

def route_topk(logits: torch.Tensor, top_k: int, *, softmax_first: bool = True, renorm: bool = False,
               round_weights: bool = False, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing after the router GEMM, one launch: logits [T, E] -> (ids [T, K] int64, weights
    [T, K] fp32), ids in descending order of probability (ties: the lowest id).

    softmax_first (qwen3 / olmoe / qwen3_next): softmax over E in fp32, top-k, divide by their sum when
    ``renorm`` (norm_topk_prob); else (mixtral, gpt-oss): top-k of the logits, softmax over those k.
    ``round_weights``: the weights rounded to the logits' dtype, then fp32 (qwen3_next's
    ``.to(h.dtype).float()``; gpt-oss's softmax in the logits' dtype).
    Same math as layers.route; the fp32 sums may be added in another order (weights can differ
    in the last bit).
    """
    _check_float("logits", logits)
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"logits must be [T, E] with 0 < top_k <= E, got {tuple(logits.shape)}, top_k={top_k}")
    if _resolve_impl(impl, logits.device) == "reference":
        ids, weights = reference.route_topk_reference(logits, top_k, softmax_first, renorm)
        return ids, (weights.to(logits.dtype).float() if round_weights else weights)
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.moe_decode.triton_kernels import route_topk_kernel
    T, E = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    block = _next_pow2(E)
    route_topk_kernel[(T,)](
        logits, ids, weights, E, logits.stride(0), K=top_k, BLOCK_E=block,
        BLOCK_K=_next_pow2(top_k), SOFTMAX_FIRST=bool(softmax_first), RENORM=bool(renorm),
        ACCURATE=_accurate(logits.device), num_warps=_row_warps(block), ROUND=bool(round_weights),
        EMU_BF16=emulate_bf16(logits), **pdl_args(logits.device))
    return ids, weights
