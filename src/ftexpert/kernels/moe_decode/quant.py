"""Entry points of the kernels over quantized expert slots: `moe_gemv_quant` (the decode MoE FFN reading
slot rows in a proto.expert_format layout and decoding them in registers) and `dequantize_rows` (slot rows
decoded into a scratch buffer in one launch, for the prefill's grouped GEMMs).

Same conventions as api.py: impl "auto" | "triton" | "reference"; no host sync, no allocation that depends
on tensor values (CUDA-graph capturable for fixed shapes); PDL launch arguments on Hopper.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ftexpert.kernels.impl import interpreted, resolve_impl
from ftexpert.kernels.pdl import pdl_args
from ftexpert.proto.expert_format import FP8_BLOCK, FormatError, QuantLayout

from ftexpert.kernels.moe_decode import quant_reference
from ftexpert.kernels.moe_decode.api import (DEFAULT_GEMV_BLOCKS, GEMV_WARPS, QUANT_GEMV_BLOCKS, CopyPlan, GemvBlocks,
                                             _accurate, _cdiv, _check_float, _next_pow2, check_bias_args)

FORMAT_IDS = {"fp8": 0, "int4": 1, "mxfp4": 2, "nvfp4": 3}     # quant_kernels.FMT_*
ROW_ALIGN = 16          # bytes: slot rows (their start and stride) hold float32 scales at 16-byte aligned offsets
MIN_BLOCK_K = 16
# The regions of a slot row each launch of a split call reads (moe_gemv_quant's between / between_down): a copy in
# two parts lands these before between() returns, and the rest (the down projection's) before between_down().
GATE_UP_REGIONS = ("codes_w13", "scales_w13", "zeros_w13", "globals")
DOWN_REGIONS = ("codes_w2", "scales_w2", "zeros_w2", "globals")


@dataclass(frozen=True)
class DequantBlocks:
    """Tile of `dequantize_rows`' programs: block_n rows x block_k columns of one matrix."""
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4


DEFAULT_DEQUANT_BLOCKS = DequantBlocks()


@dataclass(frozen=True)
class _Args:
    """What the kernels take of a QuantLayout: format id, group, byte offsets of every region in a row."""
    fmt: int
    group: int               # columns one scale covers
    row_block: int           # rows one scale covers
    codes13: int
    codes2: int
    scales_gate: int
    scales_up: int
    scales2: int
    zeros_gate: int
    zeros_up: int
    zeros2: int
    globals: int
    scale_cols13: int        # scale columns of gate / up
    scale_cols2: int         # scale columns of down


@functools.lru_cache(maxsize=None)
def _layout_args(layout: QuantLayout) -> _Args:
    f = layout.fmt
    if f.name not in FORMAT_IDS:
        raise FormatError(f"the quantized-slot kernels have no {f.label} path; formats: {', '.join(FORMAT_IDS)}")
    H, I = layout.hidden_size, layout.intermediate_size
    reg = layout.regions
    g_rows, g_cols = layout.scale_shape(I, H)
    _, d_cols = layout.scale_shape(H, I)
    zero = (0, 0)
    gate_scale_bytes = g_rows * g_cols * layout.scale_item_bytes
    return _Args(
        fmt=FORMAT_IDS[f.name], group=FP8_BLOCK if f.name == "fp8" else f.group_size,
        row_block=FP8_BLOCK if f.name == "fp8" else 1,
        codes13=reg["codes_w13"][0], codes2=reg["codes_w2"][0],
        scales_gate=reg["scales_w13"][0], scales_up=reg["scales_w13"][0] + gate_scale_bytes,
        scales2=reg["scales_w2"][0],
        zeros_gate=reg.get("zeros_w13", zero)[0], zeros_up=reg.get("zeros_w13", zero)[0] + g_rows * g_cols,
        zeros2=reg.get("zeros_w2", zero)[0], globals=reg.get("globals", zero)[0],
        scale_cols13=g_cols, scale_cols2=d_cols)


def check_rows(rows_u8: torch.Tensor, layout: QuantLayout, hidden_size: int | None = None) -> None:
    """rows_u8 must be [S, row_stride] uint8 slot rows of layout.expert_nbytes bytes or more, 16-byte aligned."""
    if not isinstance(layout, QuantLayout):
        raise TypeError(f"layout must be a proto.expert_format.QuantLayout, got {type(layout).__name__} "
                        "(bf16 experts go through moe_gemv)")
    _layout_args(layout)
    if hidden_size is not None and hidden_size != layout.hidden_size:
        raise ValueError(f"x has H = {hidden_size}, the layout H = {layout.hidden_size}")
    if rows_u8.dtype != torch.uint8 or rows_u8.dim() != 2:
        raise ValueError(f"rows_u8 must be [S, row_stride] uint8 slot rows, got {rows_u8.dtype} {tuple(rows_u8.shape)}")
    if rows_u8.shape[1] < layout.expert_nbytes:
        raise ValueError(f"rows_u8 rows are {rows_u8.shape[1]} bytes; one {layout.fmt.label} expert of H = "
                         f"{layout.hidden_size}, I = {layout.intermediate_size} takes {layout.expert_nbytes}")
    if rows_u8.stride(1) != 1 or (rows_u8.shape[0] > 1 and rows_u8.stride(0) % ROW_ALIGN) \
            or rows_u8.data_ptr() % ROW_ALIGN:
        raise ValueError(f"rows_u8 rows must be contiguous bytes starting at {ROW_ALIGN}-byte aligned addresses "
                         f"(row stride {rows_u8.stride(0)}, address % {ROW_ALIGN} = {rows_u8.data_ptr() % ROW_ALIGN}): "
                         "allocate the slot pool with a row stride that is a multiple of 16")


MMA_MIN_PROGRAMS = 512  # quant_mma's automatic split: the fewest column ranges that give this many programs


def _check_blocks(b: GemvBlocks) -> None:
    for name in ("quant_group_sum", "quant_mma", "quant_mma_down"):
        if not isinstance(getattr(b, name), bool):
            raise TypeError(f"GemvBlocks.{name} must be a bool, got {getattr(b, name)!r}")
    if b.mma_split < 0 or b.mma_split & (b.mma_split - 1):
        raise ValueError(f"GemvBlocks.mma_split = {b.mma_split}: 0 (auto) or a power of two")
    if b.mma_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"GemvBlocks.mma_warps = {b.mma_warps}: 1, 2, 4, 8 or 16")
    for name in ("gate_up_block_n", "gate_up_block_k", "down_block_n", "down_block_k"):
        v = getattr(b, name)
        if v < 1 or v & (v - 1) or (name.endswith("_k") and v < MIN_BLOCK_K):
            raise ValueError(f"GemvBlocks.{name} = {v}: moe_gemv_quant takes powers of two "
                             f"(block_k >= {MIN_BLOCK_K})")


def moe_gemv_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows_u8: torch.Tensor,
                   layout: QuantLayout, *, impl: str = "auto", blocks: GemvBlocks | None = None,
                   plan: CopyPlan | None = None, between: Callable[[], None] | None = None,
                   between_down: Callable[[], None] | None = None, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, act=None, partials: bool = False) -> torch.Tensor:
    """`moe_gemv` over quantized slot rows: -> [T, H] in x.dtype.

        y[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),   e = ids[t, k]

    rows_u8: [S, row_stride] uint8, row e = one expert in `layout` (proto.expert_format.QuantLayout: fp8,
        int4, mxfp4 or nvfp4), row_stride >= layout.expert_nbytes, rows 16-byte aligned; the weights are
        decoded in registers to the float32 values of kernels.expert_reference.dequantize_matrix, bit for bit.
    x, ids, weights, plan, between, between_down: as moe_gemv (ids -1: the route adds exactly 0 and reads
        nothing; ids are not checked against S). Rounding as moe_gemv with float32 weights: gate/up in fp32
        rounded to x.dtype, silu and act in x.dtype, down in fp32 rounded to x.dtype, times the routing weight
        in fp32, summed over k in k order. A split around a copy (plan) is bit-identical to the unsplit call;
        a copy in two parts lands GATE_UP_REGIONS of the plan's rows before between() returns and the rest
        before between_down() (the regions are not w13's bytes then w2's: QuantLayout puts all codes first).
    b13, b2, act: gpt-oss's biases and clamped SwiGLU, as moe_gemv (the biases in x.dtype, e.g. views of the
        rows' bias tails, gpu_worker/checkpoint/expert_layout.bias_views).
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
    check_rows(rows_u8, layout, x.shape[1])
    for name, t in (("x", x), ("ids", ids), ("weights", weights)):
        if t.device != rows_u8.device:
            raise ValueError(f"{name} is on {t.device}, the slot rows on {rows_u8.device}")
    if plan is not None:
        plan.check(rows_u8.device)
        if between is None:
            raise ValueError("moe_gemv_quant with a CopyPlan needs between(): the wait for the copy that fills "
                             "the plan's slots (without it the second launch would not wait)")
    if between_down is not None and between is None:
        raise ValueError("moe_gemv_quant: between_down() is the second half of a two-part wait; give between() too")
    b = blocks or QUANT_GEMV_BLOCKS.get(layout.fmt.name, DEFAULT_GEMV_BLOCKS)
    _check_blocks(b)
    T, H = x.shape
    swiglu, alpha, limit = check_bias_args(x, b13, b2, act, rows_u8.shape[0], 2 * layout.intermediate_size, H)
    impl = resolve_impl(impl, x.device)
    if b.quant_mma or b.quant_mma_down:
        _check_mma(b, layout, x, impl)
    K = ids.shape[1]
    split = plan is not None and impl != "reference" and T > 0 and K > 0
    if not split and between is not None:
        between()                       # no launch before it: waiting first keeps every read after the copy
        if between_down is not None:
            between_down()
    if impl == "reference":
        return quant_reference.moe_gemv_quant_reference(x, ids, weights, rows_u8, layout, b13, b2,
                                                        act if swiglu else None, partials)
    if T == 0 or K == 0:
        return torch.zeros(T, K, H, device=x.device) if partials else torch.zeros_like(x)
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.moe_decode.quant_kernels import moe_down_quant_kernel, moe_gate_up_quant_kernel
    from ftexpert.kernels.moe_decode.triton_kernels import moe_sum_k_kernel
    a = _layout_args(layout)
    inter = layout.intermediate_size
    P = T * K
    if x.stride(1) != 1:
        x = x.contiguous()
    ids_flat = ids.contiguous().view(-1)                              # [P]
    rw_flat = weights.contiguous().view(-1)                           # [P]
    accurate = _accurate(x.device)
    pdl = pdl_args(x.device)
    fmt = dict(FMT=a.fmt, GROUP=a.group, ROW_BLOCK=a.row_block)
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)       # [P, I]
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)       # [P, H] fp32
    if not split:
        parts, plan_args, plan_max = (0,), (ids_flat, ids_flat, -2), 1    # (the pointers are not read)
    else:
        extra = plan.extra_slot if plan.extra_slot >= 0 else -2
        parts, plan_args, plan_max = (1, 2), (plan.slots, plan.length, extra), _next_pow2(max(1, plan.max_len))
    stride_row = rows_u8.stride(0)
    bias = dict(b13_ptr=x if b13 is None else b13, stride_b=0 if b13 is None else b13.stride(0), alpha=alpha,
                limit=limit, BIAS=b13 is not None, SWIGLU=swiglu)
    for part in parts:
        if part == 2 and between is not None:
            between()                   # the copy's slots are read only after this
        if b.quant_mma:
            _gate_up_mma(x, ids_flat, rows_u8, act, plan_args, K, H, layout, a, b, part, plan_max, accurate, bias, pdl)
        else:
            moe_gate_up_quant_kernel[(P, _cdiv(inter, b.gate_up_block_n))](
                x, ids_flat, rows_u8, act, *plan_args, K, H, inter, x.stride(0), stride_row,
                a.codes13, layout.code_row_bytes(H), a.scales_gate, a.scales_up, a.zeros_gate, a.zeros_up, a.globals,
                a.scale_cols13, **fmt,
                BLOCK_N=b.gate_up_block_n, BLOCK_K=b.gate_up_block_k,
                EVEN_N=inter % b.gate_up_block_n == 0, EVEN_K=H % b.gate_up_block_k == 0,
                ACCURATE=accurate, PLAN=part, PLAN_MAX=plan_max, num_warps=GEMV_WARPS,
                GSUM=b.quant_group_sum, **bias, **pdl)
        if part == 2 and between_down is not None:
            between_down()              # the plan's w2 bytes are read only after this
        if b.quant_mma_down:
            _down_mma(act, ids_flat, rw_flat, rows_u8, y, plan_args, H, layout, a, b, part, plan_max, b2, pdl)
            continue
        moe_down_quant_kernel[(P, _cdiv(H, b.down_block_n))](
            act, ids_flat, rw_flat, rows_u8, y, *plan_args, H, inter, stride_row,
            a.codes2, layout.code_row_bytes(inter), a.scales2, a.zeros2, a.globals, a.scale_cols2, **fmt,
            BLOCK_N=b.down_block_n, BLOCK_K=b.down_block_k,
            EVEN_N=H % b.down_block_n == 0, EVEN_K=inter % b.down_block_k == 0,
            PLAN=part, PLAN_MAX=plan_max, num_warps=GEMV_WARPS,
            b2_ptr=y if b2 is None else b2, stride_b=0 if b2 is None else b2.stride(0), BIAS=b2 is not None,
            GSUM=b.quant_group_sum, **pdl)
    if partials:                                                      # the caller sums them (k order)
        return y.view(T, K, H)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)           # [T, H]
    moe_sum_k_kernel[(T, _cdiv(H, b.sum_block))](y, out, K, H, BLOCK=b.sum_block, num_warps=GEMV_WARPS, **pdl)
    return out


def _check_mma(b: GemvBlocks, layout: QuantLayout, x: torch.Tensor, impl: str) -> None:
    """GemvBlocks.quant_mma's / quant_mma_down's conditions, each refused with what to change (the activations'
    dtype only where the tensor cores run it: the reference and the interpreter take any)."""
    name = layout.fmt.name
    if name not in ("mxfp4", "nvfp4"):
        raise ValueError(f"GemvBlocks.quant_mma runs mxfp4 and nvfp4 experts, not {name}: leave it off for {name}")
    group = layout.fmt.group_size
    tiles = ([("gate_up", b.gate_up_block_n, b.gate_up_block_k)] if b.quant_mma else []) + \
        ([("down", b.down_block_n, b.down_block_k)] if b.quant_mma_down else [])
    for which, bn, bk in tiles:
        if bn < 16 or bk // group < 16:
            raise ValueError(f"GemvBlocks.quant_mma: {which}_block_n = {bn} must be >= 16 and {which}_block_k = {bk} "
                             f"must hold >= 16 groups of {group} (>= {16 * group}): the tensor cores' tile")
    if impl == "triton" and not interpreted() and x.dtype != torch.bfloat16:
        raise ValueError(f"GemvBlocks.quant_mma rounds the activations to bfloat16 on the GPU; x is {x.dtype}: "
                         "give bfloat16 activations or leave quant_mma off")


def mma_split(b: GemvBlocks, P: int, rows: int, kdim: int, down: bool = False) -> int:
    """quant_mma's column ranges of gate/up (rows I, kdim H) or down (rows H, kdim I): GemvBlocks.mma_split, or
    (0) the fewest (a power of two) that give MMA_MIN_PROGRAMS programs, at most one K step each."""
    bn, bk = (b.down_block_n, b.down_block_k) if down else (b.gate_up_block_n, b.gate_up_block_k)
    steps = _cdiv(kdim, bk)
    if b.mma_split:
        return min(b.mma_split, steps)
    split, programs = 1, P * _cdiv(rows, bn)
    while programs * split < MMA_MIN_PROGRAMS and split * 2 <= steps:
        split *= 2
    return split


def _ranges(b: GemvBlocks, P: int, rows: int, kdim: int, down: bool) -> tuple[int, int]:
    """(ranges, columns a range): a range past kdim would add nothing, so none is launched."""
    bk = b.down_block_k if down else b.gate_up_block_k
    k_split = _cdiv(_cdiv(kdim, bk), mma_split(b, P, rows, kdim, down)) * bk
    return _cdiv(kdim, k_split), k_split


def _down_mma(act, ids_flat, rw_flat, rows_u8, y, plan_args, H, layout, a, b, part, plan_max, b2, pdl):
    """The down launch of GemvBlocks.quant_mma_down (quant_mma_kernels.py), then, split, the outputs' launch."""
    from ftexpert.kernels.moe_decode.quant_mma_kernels import moe_down_from_parts_kernel, moe_down_quant_mma_kernel
    P, inter, bn, bk = ids_flat.shape[0], layout.intermediate_size, b.down_block_n, b.down_block_k
    split, k_split = _ranges(b, P, H, inter, down=True)
    parts = y if split == 1 else torch.empty(split, P, H, dtype=torch.float32, device=y.device)
    bias = dict(b2_ptr=y if b2 is None else b2, stride_b=0 if b2 is None else b2.stride(0), BIAS=b2 is not None)
    moe_down_quant_mma_kernel[(P, _cdiv(H, bn), split)](
        act, ids_flat, rw_flat, rows_u8, y, parts, *plan_args, H, inter, P, rows_u8.stride(0),
        a.codes2, layout.code_row_bytes(inter), a.scales2, a.globals, a.scale_cols2, k_split,
        FMT=a.fmt, GROUP=a.group, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=H % bn == 0, EVEN_K=inter % bk == 0,
        PLAN=part, PLAN_MAX=plan_max, SPLIT=split, ASM=not interpreted(), num_warps=b.mma_warps, **bias, **pdl)
    if split > 1:
        moe_down_from_parts_kernel[(P, _cdiv(H, b.sum_block))](
            parts, ids_flat, rw_flat, y, act, *plan_args, P, H, BLOCK=b.sum_block, PLAN=part, PLAN_MAX=plan_max,
            SPLIT=split, num_warps=GEMV_WARPS, **bias, **pdl)


def _gate_up_mma(x, ids_flat, rows_u8, act, plan_args, K, H, layout, a, b, part, plan_max, accurate, bias, pdl):
    """The gate/up launch of GemvBlocks.quant_mma (quant_mma_kernels.py), then, split, the activations' launch."""
    from ftexpert.kernels.moe_decode.quant_mma_kernels import moe_act_from_parts_kernel, moe_gate_up_quant_mma_kernel
    P, inter, bn, bk = ids_flat.shape[0], layout.intermediate_size, b.gate_up_block_n, b.gate_up_block_k
    split, k_split = _ranges(b, P, inter, H, down=False)
    parts = act if split == 1 else torch.empty(split, P, 2, inter, dtype=torch.float32, device=x.device)
    moe_gate_up_quant_mma_kernel[(P, _cdiv(inter, bn), split)](
        x, ids_flat, rows_u8, act, parts, *plan_args, K, H, inter, P, x.stride(0), rows_u8.stride(0),
        a.codes13, layout.code_row_bytes(H), a.scales_gate, a.scales_up, a.globals, a.scale_cols13, k_split,
        FMT=a.fmt, GROUP=a.group, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=inter % bn == 0, EVEN_K=H % bk == 0,
        ACCURATE=accurate, PLAN=part, PLAN_MAX=plan_max, SPLIT=split, ASM=not interpreted(), num_warps=b.mma_warps,
        **bias, **pdl)
    if split > 1:
        moe_act_from_parts_kernel[(P, _cdiv(inter, b.sum_block))](
            parts, ids_flat, act, *plan_args, P, inter, BLOCK=b.sum_block, ACCURATE=accurate, PLAN=part,
            PLAN_MAX=plan_max, SPLIT=split, num_warps=GEMV_WARPS, **bias, **pdl)


def dequantize_rows(rows_u8: torch.Tensor, ids: torch.Tensor, layout: QuantLayout, out_dtype: torch.dtype, *,
                    impl: str = "auto", out: torch.Tensor | None = None,
                    blocks: DequantBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot rows ids [n] decoded in one launch -> (w13 [n, 2I, H], w2 [n, H, I]) in out_dtype.

    The values are dequantize_matrix's float32 ones, bit for bit, rounded to out_dtype (nearest even);
    an id of -1 gives zeros. Both are views into one packed [n, 3 * I * H] buffer (the bf16 expert layout,
    gpu_worker.checkpoint.expert_layout): `out` when given (out_dtype, [n, >= 3 * I * H], contiguous rows),
    else a new one. For the prefill: dequantize a layer's rows (e.g. ids = arange(S)) into a scratch
    buffer, then run the bf16 grouped FFN over (w13, w2) with the routes' indices into ids.
    """
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    check_rows(rows_u8, layout)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != rows_u8.device:
        raise ValueError(f"ids must be a 1-D int32 / int64 tensor on {rows_u8.device}, got {ids.dtype} "
                         f"{tuple(ids.shape)} on {ids.device}")
    H, I = layout.hidden_size, layout.intermediate_size
    n, numel = ids.shape[0], 3 * I * H
    if out is None:
        out = torch.empty(n, numel, dtype=out_dtype, device=rows_u8.device)
    elif (out.dtype != out_dtype or out.dim() != 2 or out.shape[0] != n or out.shape[1] < numel
          or out.stride(1) != 1 or out.device != rows_u8.device):
        raise ValueError(f"out must be [{n}, >= {numel}] {out_dtype} on {rows_u8.device} with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    w13 = out[:, :2 * I * H].view(n, 2 * I, H)
    w2 = out[:, 2 * I * H:numel].view(n, H, I)
    if resolve_impl(impl, rows_u8.device) == "reference":
        r13, r2 = quant_reference.dequantize_rows_reference(rows_u8, ids, layout, out_dtype)
        w13.copy_(r13)
        w2.copy_(r2)
        return w13, w2
    if n == 0:
        return w13, w2
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.moe_decode.quant_kernels import dequantize_rows_kernel
    a = _layout_args(layout)
    b = blocks or DEFAULT_DEQUANT_BLOCKS
    if b.block_n & (b.block_n - 1) or b.block_k & (b.block_k - 1) or b.block_k < MIN_BLOCK_K:
        raise ValueError(f"DequantBlocks {b}: block_n and block_k must be powers of two, block_k >= {MIN_BLOCK_K}")
    tiles13_k = _cdiv(H, b.block_k)
    tiles13 = _cdiv(I, b.block_n) * tiles13_k
    tiles2_k = _cdiv(I, b.block_k)
    tiles2 = _cdiv(H, b.block_n) * tiles2_k
    if rows_u8.shape[0] == 0:                 # nothing to read: every id is -1
        out[:, :numel].zero_()
        return w13, w2
    dequantize_rows_kernel[(n, 2 * tiles13 + tiles2)](
        rows_u8, ids, out, H, I, rows_u8.stride(0), out.stride(0),
        a.codes13, a.codes2, layout.code_row_bytes(H), layout.code_row_bytes(I),
        a.scales_gate, a.scales_up, a.scales2, a.zeros_gate, a.zeros_up, a.zeros2,
        a.globals, a.scale_cols13, a.scale_cols2, tiles13_k, tiles13, tiles2_k,
        FMT=a.fmt, GROUP=a.group, ROW_BLOCK=a.row_block, BLOCK_N=b.block_n, BLOCK_K=b.block_k,
        num_warps=b.num_warps, **pdl_args(rows_u8.device))
    return w13, w2
