"""Expert weight formats: the byte layout of one (possibly quantized) expert (names, regions, sizes; no maths).

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
