"""Expert weight formats: the byte layout of one (possibly quantized) expert, and its reference codec.

This is a cross-process contract: the shared expert store, the GPU slot pool and the CPU expert pool
hold one expert as one contiguous byte range laid out as below, so an expert still moves as one copy.

An expert has three matrices, each ``[rows, K]`` in Hugging Face ``[out, in]`` order:
``gate [I, H]``, ``up [I, H]``, ``down [H, I]`` (H hidden, I expert intermediate). ``w13`` is gate's
rows then up's rows (``[2I, H]``); ``w2`` is down. Every format quantizes along K (the input dim).

    bf16   the unquantized layout: w13 then w2, bfloat16 (gpu_worker.checkpoint.expert_layout)
    fp8    codes float8_e4m3fn, 1 byte/weight; scales float32 per 128x128 block of each matrix
           (DeepSeek-V3 ``weight_scale_inv``): w = code * scale[r // 128, k // 128]
    int4   codes 4-bit unsigned u, 2/byte; per group of G (32, 64, 128) along K: scale float32 and
           zero point uint8 (8 when symmetric): w = (u - zero) * scale
    mxfp4  codes E2M1, 2/byte; per group of 32: an E8M0 scale byte e: w = fp4(code) * 2**(e - 127)
    nvfp4  codes E2M1, 2/byte; per group of 16: an E4M3 scale byte s, and one float32 global scale per
           matrix (gate, up, down): w = fp4(code) * e4m3(s) * global

4-bit packing: element k of a row is in byte k // 2 of that row, the low nibble for even k (the
layout of gpt-oss ``_blocks``, compressed-tensors ``pack-quantized`` read as little-endian bytes).
E2M1 nibble: bit 3 sign, then the magnitude index into (0, .5, 1, 1.5, 2, 3, 4, 6).

Byte layout of one quantized expert (every region starts at a multiple of ``REGION_ALIGN`` bytes):

    codes_w13 [2I, H * b]   codes_w2 [H, I * b]        (b = bytes per weight: 1 or 1/2)
    scales_w13              scales_w2                   (gate's scales then up's, no gap)
    zeros_w13               zeros_w2                    (int4 only) [rows, K / G] uint8
    globals                 (nvfp4 only) float32 [3]: gate, up, down

Group-wise scales are ``[rows, K / G]`` row-major; fp8's are gate ``[ceil(I/128), ceil(H/128)]``,
then up's (same shape), and down's ``[ceil(H/128), ceil(I/128)]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("bf16", "fp8", "int4", "mxfp4", "nvfp4")
REGION_ALIGN = 16
FP8_BLOCK = 128
FP8_MAX = 448.0
INT4_GROUPS = (32, 64, 128)
FIXED_GROUP = {"mxfp4": 32, "nvfp4": 16}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0


class FormatError(ValueError):
    """A format, group size or shape the kernels do not support, or tensors of the wrong shape."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int) -> int:
    return _ceil(n, REGION_ALIGN) * REGION_ALIGN


@dataclass(frozen=True)
class ExpertFormat:
    name: str                  # one of FORMATS
    group_size: int = 0        # int4: 32 / 64 / 128; fixed for mxfp4 (32) / nvfp4 (16); 0 otherwise

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise FormatError(f"expert format {self.name!r} is not supported; use one of {', '.join(FORMATS)}")
        if self.name == "int4" and self.group_size not in INT4_GROUPS:
            raise FormatError(f"int4 group size {self.group_size} is not supported; use one of {INT4_GROUPS}")
        if self.name in FIXED_GROUP and self.group_size not in (0, FIXED_GROUP[self.name]):
            raise FormatError(f"{self.name} has groups of {FIXED_GROUP[self.name]}, not {self.group_size}")
        if self.name in ("bf16", "fp8") and self.group_size:
            raise FormatError(f"{self.name} takes no group size (got {self.group_size})")
        if self.name in FIXED_GROUP and not self.group_size:
            object.__setattr__(self, "group_size", FIXED_GROUP[self.name])

    @classmethod
    def parse(cls, text: str) -> "ExpertFormat":
        """``bf16``, ``fp8``, ``int4`` (group 128), ``int4-g32`` / ``int4-g64``, ``mxfp4``, ``nvfp4``."""
        name, _, group = text.strip().lower().partition("-g")
        if name == "int4":
            return cls("int4", int(group) if group.isdigit() else 128 if not group else -1)
        if group:
            raise FormatError(f"expert format {text!r}: only int4 takes a group size (int4-g32/-g64/-g128)")
        return cls(name)

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.name == "int4" else self.name

    @property
    def quantized(self) -> bool:
        return self.name != "bf16"

    @property
    def four_bit(self) -> bool:
        return self.name in ("int4", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class QuantLayout:
    """Offsets (bytes) of every region of one expert of shape H, I in ``fmt``."""
    hidden_size: int           # H
    intermediate_size: int     # I
    fmt: ExpertFormat

    def __post_init__(self) -> None:
        H, I, f = self.hidden_size, self.intermediate_size, self.fmt
        if not f.quantized:
            raise FormatError("QuantLayout describes quantized formats; bf16 uses ExpertLayout")
        if f.group_size:
            for k, what in ((H, "hidden size"), (I, "intermediate size")):
                if k % f.group_size:
                    raise FormatError(f"{f.label}: group size {f.group_size} does not divide the {what} {k}")
        if f.four_bit and (H % 2 or I % 2):
            raise FormatError(f"{f.label} packs two weights a byte: H={H} and I={I} must be even")

    # -- per-matrix sizes ------------------------------------------------------------------------
    def code_row_bytes(self, k: int) -> int:
        return k // 2 if self.fmt.four_bit else k

    def scale_shape(self, rows: int, k: int) -> tuple[int, int]:
        if self.fmt.name == "fp8":
            return _ceil(rows, FP8_BLOCK), _ceil(k, FP8_BLOCK)
        return rows, k // self.fmt.group_size

    @property
    def scale_item_bytes(self) -> int:
        return 4 if self.fmt.name in ("fp8", "int4") else 1

    def _regions(self) -> dict[str, tuple[int, int]]:
        H, I = self.hidden_size, self.intermediate_size
        sizes: list[tuple[str, int]] = [
            ("codes_w13", 2 * I * self.code_row_bytes(H)), ("codes_w2", H * self.code_row_bytes(I))]
        g_rows, g_cols = self.scale_shape(I, H)
        d_rows, d_cols = self.scale_shape(H, I)
        sizes += [("scales_w13", 2 * g_rows * g_cols * self.scale_item_bytes),
                  ("scales_w2", d_rows * d_cols * self.scale_item_bytes)]
        if self.fmt.name == "int4":
            sizes += [("zeros_w13", 2 * g_rows * g_cols), ("zeros_w2", d_rows * d_cols)]
        if self.fmt.name == "nvfp4":
            sizes += [("globals", 3 * 4)]
        out, off = {}, 0
        for name, n in sizes:
            out[name] = (off, n)
            off = _align(off + n)
        return out

    @property
    def regions(self) -> dict[str, tuple[int, int]]:
        """name -> (byte offset, byte length)."""
        return self._regions()

    @property
    def expert_nbytes(self) -> int:
        last_off, last_len = list(self._regions().values())[-1]
        return _align(last_off + last_len)


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
