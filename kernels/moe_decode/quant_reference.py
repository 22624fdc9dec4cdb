"""Plain-torch references of the quantized-expert kernels: the dequantization of slot rows and the MoE GEMV over
them. Same signatures as the fast kernels (kernels/moe_decode/quant.py), so that gpu_worker/models/expert_math.py
takes either.

- `dequantize_rows(rows_u8, ids, layout, out_dtype)`: rows ``ids`` of a pool of quantized experts -> their
  ``w13 [n, 2I, H]`` and ``w2 [n, H, I]`` in ``out_dtype``, bit-identical to
  ``proto.expert_format.dequantize_expert`` of each row cast to ``out_dtype`` (the same fp32 products in the
  same order, vectorised over the rows; fp4 decoded arithmetically rather than through a table, so that nothing
  is copied from the host and the call is CUDA-graph capturable).
- `moe_gemv_quant(x, ids, weights, rows_u8, layout, ...)`: `kernels.moe_decode.moe_gemv`'s semantics over
  quantized rows: the routed rows dequantized to x.dtype (`dequantize_rows`), then `moe_gemv` over them with the
  same ``impl``; bit-identical to `moe_gemv` over a pool holding the dequantized experts.

Legend: S rows (slots), N bytes a row, n rows dequantized, T tokens, K routes a token, H hidden, I intermediate.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from proto.expert_format import FP8_BLOCK, FormatError, QuantLayout, e4m3_decode, e8m0_decode

from .api import CopyPlan, moe_gemv

DEQUANT_CHUNK_BYTES = 1 << 28      # fp32 temporaries of one dequantized chunk of rows, at most about this


def fp4_values(nib: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 nibbles -> float32, the values (and signs, -0.0 for nibble 8) of proto.expert_format.fp4_decode."""
    n = nib.to(torch.int32)
    exp, mant = (n >> 1) & 3, (n & 1).to(torch.float32)
    normal = (1.0 + 0.5 * mant) * torch.exp2((exp - 1).to(torch.float32))
    mag = torch.where(exp == 0, 0.5 * mant, normal)
    return torch.where((n & 8) != 0, -mag, mag)


def _repeat(t: torch.Tensor, g: int, dim: int) -> torch.Tensor:
    """t.repeat_interleave(g, dim) as a view expanded then copied: no host sync (CUDA-graph capturable)."""
    shape = list(t.shape)
    shape[dim] *= g
    return t.unsqueeze(dim + 1).expand(*t.shape[:dim + 1], g, *t.shape[dim + 1:]).reshape(shape)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[n, rows, K/2] uint8 -> [n, rows, K] nibbles, even k in the low nibble."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(codes.shape[0], codes.shape[1], -1)


def _region(rows: torch.Tensor, layout: QuantLayout, name: str, dtype: torch.dtype, shape: tuple[int, int],
            part: int = 0) -> torch.Tensor:
    """[n, N] bytes -> the region ``name`` (its ``part``-th matrix) as [n, *shape] ``dtype``."""
    off, _ = layout.regions[name]
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = shape[0] * shape[1] * item
    lo = off + part * nbytes
    return rows[:, lo:lo + nbytes].contiguous().view(dtype).view(rows.shape[0], *shape)


def _matrix(rows: torch.Tensor, layout: QuantLayout, which: int) -> torch.Tensor:
    """Matrix ``which`` (0 gate, 1 up, 2 down) of n expert rows -> float32 [n, rows, K], as dequantize_matrix."""
    H, I, fmt = layout.hidden_size, layout.intermediate_size, layout.fmt
    r, k = (I, H) if which < 2 else (H, I)
    region = "w13" if which < 2 else "w2"
    part = which if which < 2 else 0
    cb = layout.code_row_bytes(k)
    off, _ = layout.regions[f"codes_{region}"]
    lo = off + part * r * cb
    codes = rows[:, lo:lo + r * cb].reshape(rows.shape[0], r, cb)          # [n, r, K*b]
    sshape = layout.scale_shape(r, k)
    sdt = torch.float32 if layout.scale_item_bytes == 4 else torch.uint8
    scales = _region(rows, layout, f"scales_{region}", sdt, sshape, part)    # [n, sr, sc]
    if fmt.name == "fp8":
        vals = codes.contiguous().view(torch.float8_e4m3fn).float()
        sc = _repeat(_repeat(scales.float(), FP8_BLOCK, 1), FP8_BLOCK, 2)
        return vals * sc[:, :r, :k]
    g = fmt.group_size
    nib = _nibbles(codes)
    if fmt.name == "int4":
        zeros = _region(rows, layout, f"zeros_{region}", torch.uint8, sshape, part)
        vals = nib.float() - _repeat(zeros.float(), g, 2)
        return vals * _repeat(scales.float(), g, 2)
    if fmt.name == "mxfp4":
        return fp4_values(nib) * _repeat(e8m0_decode(scales), g, 2)
    if fmt.name == "nvfp4":
        glob = _region(rows, layout, "globals", torch.float32, (1, 3))[:, 0, which]      # [n]
        return fp4_values(nib) * _repeat(e4m3_decode(scales) * glob[:, None, None], g, 2)
    raise FormatError(f"dequantize_rows: {fmt.label} is not a quantized format")


def _check_rows(rows_u8: torch.Tensor, layout: QuantLayout) -> None:
    if not isinstance(layout, QuantLayout):
        raise FormatError(f"the quantized-expert kernels take a proto.expert_format.QuantLayout, got "
                          f"{type(layout).__name__}")
    if rows_u8.dtype != torch.uint8 or rows_u8.dim() != 2 or rows_u8.shape[1] < layout.expert_nbytes \
            or rows_u8.stride(1) != 1:
        raise FormatError(f"{layout.fmt.label} expert rows must be uint8 [S, >= {layout.expert_nbytes}] with "
                          f"contiguous rows, got {rows_u8.dtype} {tuple(rows_u8.shape)}")


def dequantize_rows(rows_u8: torch.Tensor, ids_u32: torch.Tensor, layout: QuantLayout,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``ids_u32`` [n] (values in [0, S), not checked) of ``rows_u8`` [S, N] -> (w13 [n, 2I, H], w2 [n, H, I])
    in ``out_dtype``: each bit-identical to dequantize_expert(rows_u8[id], layout) cast to out_dtype."""
    _check_rows(rows_u8, layout)
    H, I = layout.hidden_size, layout.intermediate_size
    ids = ids_u32.reshape(-1).to(torch.int64)
    n = ids.numel()
    w13 = torch.empty(n, 2 * I, H, dtype=out_dtype, device=rows_u8.device)
    w2 = torch.empty(n, H, I, dtype=out_dtype, device=rows_u8.device)
    chunk = max(1, DEQUANT_CHUNK_BYTES // (3 * H * I * 4 * 3))        # fp32 values, scales and nibbles alive
    nbytes = layout.expert_nbytes
    for lo in range(0, n, chunk):
        sel = rows_u8[:, :nbytes].index_select(0, ids[lo:lo + chunk])     # [c, N] bytes of the chunk's rows
        w13[lo:lo + chunk, :I] = _matrix(sel, layout, 0)
        w13[lo:lo + chunk, I:] = _matrix(sel, layout, 1)
        w2[lo:lo + chunk] = _matrix(sel, layout, 2)
    return w13, w2


def moe_gemv_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows_u8: torch.Tensor,
                   layout: QuantLayout, *, impl: str = "auto", plan: CopyPlan | None = None,
                   between: Callable[[], None] | None = None,
                   between_down: Callable[[], None] | None = None) -> torch.Tensor:
    """`moe_gemv` over quantized rows ``rows_u8`` [S, N]: x [T, H], ids [T, K] (row ids, -1: adds exactly 0),
    weights [T, K] -> [T, H] in x.dtype. The reference dequantizes after the copy has landed, so ``between()``
    and ``between_down()`` both run first (no split); ``impl`` is the bf16 GEMV's over the dequantized rows."""
    _check_rows(rows_u8, layout)
    if ids.dim() != 2 or weights.shape != ids.shape or x.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_gemv_quant: x {tuple(x.shape)}, ids {tuple(ids.shape)} and weights "
                         f"{tuple(weights.shape)} must be [T, H], [T, K], [T, K]")
    if x.shape[1] != layout.hidden_size:
        raise ValueError(f"moe_gemv_quant: x has H = {x.shape[1]}, the experts {layout.hidden_size}")
    if plan is not None and between is None:
        raise ValueError("moe_gemv_quant with a CopyPlan needs between(): the wait for the copy that fills the "
                         "plan's slots")
    if between_down is not None and between is None:
        raise ValueError("moe_gemv_quant: between_down() is the second half of a two-part wait; give between() too")
    if between is not None:
        between()
    if between_down is not None:
        between_down()
    T, K = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    valid = flat >= 0
    w13, w2 = dequantize_rows(rows_u8, torch.where(valid, flat, 0), layout, x.dtype)    # [T*K, 2I, H], [T*K, H, I]
    local = torch.where(valid, torch.arange(T * K, device=ids.device), -1).view(T, K)
    return moe_gemv(x, local, weights, w13, w2, impl=impl)
