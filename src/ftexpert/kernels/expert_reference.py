"""The reference maths of one expert over the layouts proto/ describes: the codec of the quantized formats
(proto/expert_format.py: quantize at load, dequantize as the plain reference, pack and unpack one expert's bytes)
and the activation between an expert's two matrices (proto/expert_act.py's ExpertAct).

Shared by every process that computes or loads experts: the GPU worker's checkpoint loading and expert math, the
CPU expert workers' torch kernel and reference, and the Triton kernels' references. proto keeps the layouts
(names, regions, byte sizes) torch-free, so the coordinator can size and create the expert store without torch;
the maths, which needs torch, is here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.proto.expert_act import ExpertAct
from ftexpert.proto.expert_format import (FP4_MAX, FP4_VALUES, FP8_BLOCK, FP8_MAX, ExpertFormat, FormatError,
                                          QuantLayout)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# -- element codecs -----------------------------------------------------------------------------------
def fp4_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (0..15) -> float32 E2M1 values."""
    lut = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32, device=nibbles.device)
    return lut[nibbles.long()]


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> nearest E2M1 nibble (ties to the smaller magnitude), saturating at +-6."""
    grid = torch.tensor(FP4_VALUES, dtype=torch.float32, device=x.device)
    idx = (x.abs().clamp(max=FP4_MAX).unsqueeze(-1) - grid).abs().argmin(dim=-1).to(torch.uint8)
    return idx | ((x < 0) & (idx > 0)).to(torch.uint8) << 3


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[rows, K] values 0..15 -> [rows, K/2] uint8, even k in the low nibble."""
    u = u.to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """[rows, K/2] uint8 -> [rows, K] uint8 nibbles."""
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1)


def e8m0_decode(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.float() - 127.0)


def e4m3_decode(s: torch.Tensor) -> torch.Tensor:
    return s.contiguous().view(torch.float8_e4m3fn).float()


# -- one matrix ---------------------------------------------------------------------------------------
@dataclass
class QuantMatrix:
    """One quantized matrix [rows, K]: codes [rows, K*b] uint8, scales, zeros (int4), global (nvfp4)."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    global_scale: float = 1.0


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[1] // g, g)


def quantize_matrix(w: torch.Tensor, fmt: ExpertFormat) -> QuantMatrix:
    """Round-to-nearest quantization of a float matrix [rows, K] (the load-time quantizer)."""
    w = w.float()
    rows, k = w.shape
    if fmt.name == "fp8":
        sr, sc = _ceil(rows, FP8_BLOCK), _ceil(k, FP8_BLOCK)
        pad = torch.zeros(sr * FP8_BLOCK, sc * FP8_BLOCK, dtype=torch.float32, device=w.device)
        pad[:rows, :k] = w
        blocks = pad.view(sr, FP8_BLOCK, sc, FP8_BLOCK)
        amax = blocks.abs().amax(dim=(1, 3))
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        codes = q.view(sr * FP8_BLOCK, sc * FP8_BLOCK)[:rows, :k].contiguous().view(torch.uint8)
        return QuantMatrix(codes, scales.contiguous())
    g = fmt.group_size
    if k % g:
        raise FormatError(f"{fmt.label}: group size {g} does not divide K={k}")
    grp = _groups(w, g)
    amax = grp.abs().amax(dim=-1)
    if fmt.name == "int4":
        scales = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
        u = (torch.round(grp / scales[..., None]) + 8).clamp(0, 15).reshape(rows, k)
        zeros = torch.full((rows, k // g), 8, dtype=torch.uint8, device=w.device)
        return QuantMatrix(pack_nibbles(u), scales.contiguous(), zeros)
    if fmt.name == "mxfp4":
        # OCP MX: shared exponent floor(log2(amax)) - 2 (E2M1's largest exponent), clamped to E8M0.
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2,
                          torch.full_like(amax, -127.0)).clamp(-127, 127)
        codes = fp4_encode(grp / torch.exp2(exp)[..., None]).reshape(rows, k)
        return QuantMatrix(pack_nibbles(codes), (exp + 127).to(torch.uint8))
    if fmt.name == "nvfp4":
        tmax = float(w.abs().max())
        glob = float(torch.tensor(tmax / (FP8_MAX * FP4_MAX) if tmax > 0 else 1.0, dtype=torch.float32))
        s = (amax / FP4_MAX / glob).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
        sf = s.float() * glob
        sf = torch.where(sf > 0, sf, torch.ones_like(sf))
        codes = fp4_encode(grp / sf[..., None]).reshape(rows, k)
        return QuantMatrix(pack_nibbles(codes), s.view(torch.uint8), None, glob)
    raise FormatError(f"quantize_matrix: {fmt.label} is not a quantized format")


def dequantize_matrix(q: QuantMatrix, fmt: ExpertFormat, rows: int, k: int) -> torch.Tensor:
    """The plain reference: QuantMatrix -> float32 [rows, K]."""
    if fmt.name == "fp8":
        vals = q.codes.contiguous().view(torch.float8_e4m3fn).float()
        sc = q.scales.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        return vals * sc[:rows, :k]
    g = fmt.group_size
    nib = unpack_nibbles(q.codes)
    if fmt.name == "int4":
        vals = nib.float() - q.zeros.float().repeat_interleave(g, 1)
        return vals * q.scales.float().repeat_interleave(g, 1)
    if fmt.name == "mxfp4":
        return fp4_decode(nib) * e8m0_decode(q.scales).repeat_interleave(g, 1)
    if fmt.name == "nvfp4":
        return fp4_decode(nib) * (e4m3_decode(q.scales) * q.global_scale).repeat_interleave(g, 1)
    raise FormatError(f"dequantize_matrix: {fmt.label} is not a quantized format")


# -- one expert ---------------------------------------------------------------------------------------
def _put(row: torch.Tensor, layout: QuantLayout, region: str, data: torch.Tensor, at: int = 0) -> int:
    off, n = layout.regions[region]
    flat = data.contiguous().view(torch.uint8).reshape(-1)
    if at + flat.numel() > n:
        raise FormatError(f"{region}: {at + flat.numel()} bytes do not fit its {n}")
    row[off + at: off + at + flat.numel()] = flat
    return at + flat.numel()


def pack_expert(gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, layout: QuantLayout,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Three quantized matrices -> one expert's bytes [expert_nbytes] uint8 (into ``out`` when given)."""
    H, I = layout.hidden_size, layout.intermediate_size
    checks = ((gate, I, H, "gate"), (up, I, H, "up"), (down, H, I, "down"))
    for m, rows, k, what in checks:
        if tuple(m.codes.shape) != (rows, layout.code_row_bytes(k)):
            raise FormatError(f"{what}: codes {tuple(m.codes.shape)}, expected {(rows, layout.code_row_bytes(k))}")
        if tuple(m.scales.shape) != layout.scale_shape(rows, k):
            raise FormatError(f"{what}: scales {tuple(m.scales.shape)}, expected {layout.scale_shape(rows, k)}")
    row = torch.zeros(layout.expert_nbytes, dtype=torch.uint8) if out is None else out
    scale_dtype = torch.float32 if layout.scale_item_bytes == 4 else torch.uint8
    at = _put(row, layout, "codes_w13", gate.codes)
    _put(row, layout, "codes_w13", up.codes, at)
    _put(row, layout, "codes_w2", down.codes)
    at = _put(row, layout, "scales_w13", gate.scales.to(scale_dtype))
    _put(row, layout, "scales_w13", up.scales.to(scale_dtype), at)
    _put(row, layout, "scales_w2", down.scales.to(scale_dtype))
    if layout.fmt.name == "int4":
        at = _put(row, layout, "zeros_w13", gate.zeros)
        _put(row, layout, "zeros_w13", up.zeros, at)
        _put(row, layout, "zeros_w2", down.zeros)
    if layout.fmt.name == "nvfp4":
        _put(row, layout, "globals", torch.tensor([gate.global_scale, up.global_scale, down.global_scale],
                                                 dtype=torch.float32))
    return row


def _take(row: torch.Tensor, layout: QuantLayout, region: str, dtype: torch.dtype, shape: tuple[int, int],
          part: int = 0) -> torch.Tensor:
    off, _ = layout.regions[region]
    item = torch.empty((), dtype=dtype).element_size()
    n = shape[0] * shape[1] * item
    return row[off + part * n: off + (part + 1) * n].view(dtype).view(shape)


def unpack_expert(row: torch.Tensor, layout: QuantLayout) -> tuple[QuantMatrix, QuantMatrix, QuantMatrix]:
    """Views of one expert's bytes as its gate, up and down QuantMatrix (no copy)."""
    if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() < layout.expert_nbytes:
        raise FormatError(f"an expert row is {layout.expert_nbytes} uint8 bytes; got {row.dtype} "
                          f"{tuple(row.shape)}")
    H, I, f = layout.hidden_size, layout.intermediate_size, layout.fmt
    sdt = torch.float32 if layout.scale_item_bytes == 4 else torch.uint8
    cw13 = _take(row, layout, "codes_w13", torch.uint8, (2 * I, layout.code_row_bytes(H)))
    down_codes = _take(row, layout, "codes_w2", torch.uint8, (H, layout.code_row_bytes(I)))
    gs, ds = layout.scale_shape(I, H), layout.scale_shape(H, I)
    mats = []
    for i, (codes, rows, k, region, part) in enumerate(((cw13[:I], I, H, "w13", 0), (cw13[I:], I, H, "w13", 1),
                                                        (down_codes, H, I, "w2", 0))):
        shape = gs if region == "w13" else ds
        scales = _take(row, layout, f"scales_{region}", sdt, shape, part)
        zeros = _take(row, layout, f"zeros_{region}", torch.uint8, shape, part) if f.name == "int4" else None
        glob = float(_take(row, layout, "globals", torch.float32, (1, 3))[0, i]) if f.name == "nvfp4" else 1.0
        mats.append(QuantMatrix(codes, scales, zeros, glob))
    return mats[0], mats[1], mats[2]


def quantize_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: ExpertFormat,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Float gate [I, H], up [I, H], down [H, I] -> one expert's bytes in ``fmt``."""
    layout = QuantLayout(gate.shape[1], gate.shape[0], fmt)
    return pack_expert(quantize_matrix(gate, fmt), quantize_matrix(up, fmt), quantize_matrix(down, fmt),
                       layout, out)


def dequantize_expert(row: torch.Tensor, layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's bytes -> float32 gate [I, H], up [I, H], down [H, I] (the plain reference)."""
    H, I = layout.hidden_size, layout.intermediate_size
    g, u, d = unpack_expert(row, layout)
    return (dequantize_matrix(g, layout.fmt, I, H), dequantize_matrix(u, layout.fmt, I, H),
            dequantize_matrix(d, layout.fmt, H, I))


# -- the activation ---------------------------------------------------------------------------------
def apply_act(gate_up: torch.Tensor, act: ExpertAct) -> torch.Tensor:
    """gate_up [..., 2I] (gate's I then up's I, biases added) -> h [..., I] in its dtype (transformers' rounding)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if act.name == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))
