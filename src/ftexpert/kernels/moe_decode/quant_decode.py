"""The decoders of the quantized codes, in registers (quant_kernels.py's docstring says how and why; quant_words.py
and quant_kernels.py share them)."""
from __future__ import annotations

import triton
import triton.language as tl

FMT_FP8: tl.constexpr = tl.constexpr(0)
FMT_INT4: tl.constexpr = tl.constexpr(1)
FMT_MXFP4: tl.constexpr = tl.constexpr(2)
FMT_NVFP4: tl.constexpr = tl.constexpr(3)
E4M3_FIX: tl.constexpr = tl.constexpr(2.0 ** 120)     # float32 bits of an E4M3 byte moved into place: value * 2**-120
E2M1_FIX: tl.constexpr = tl.constexpr(2.0 ** 126)     # float32 bits of an E2M1 nibble moved into place: value * 2**-126
MAGIC_2P23: tl.constexpr = tl.constexpr(0x4B000000)   # float32 bits of 2**23
E4M3_MASK: tl.constexpr = tl.constexpr(0x87F00000 - (1 << 32))   # bits 31 and 26..20 (as an int32)
E2M1_MASK: tl.constexpr = tl.constexpr(0x81C00000 - (1 << 32))   # bits 31 and 24..22 (as an int32)
GSUM_X: tl.constexpr = tl.constexpr(2.0 ** 64)       # GSUM, E2M1: x scaled so that (value * 2**-126) * x' is normal
GSUM_UNDO: tl.constexpr = tl.constexpr(2.0 ** 62)    # ... and a group's sum scaled back: 2**126 / 2**64


@triton.jit
def _e4m3_to_f32(b):
    """uint8 E4M3 bytes -> their float32 values (exact; NaN codes give +-480). The byte
    sign-extended and shifted by 20 has the sign in bits 31..27 and exponent, mantissa in 26..20; the mask
    keeps bit 31 and 26..20 (one PRMT / shift / LOP3 a byte on the GPU)."""
    bits = (b.to(tl.int8, bitcast=True).to(tl.int32) << 20) & E4M3_MASK
    return bits.to(tl.float32, bitcast=True) * E4M3_FIX


@triton.jit
def _e2m1_bits(top):
    """int32 with an E2M1 nibble in bits 31..28 -> its float32 value * 2**-126 (exact, a subnormal or tiny
    normal): shifted right arithmetically by 6 and masked, the sign is in bit 31 and exponent, mantissa in bits
    24..22."""
    return ((top >> 6) & E2M1_MASK).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(top):
    """int32 with an E2M1 nibble in bits 31..28 -> its float32 value (exact, -0.0 for 0x8)."""
    return _e2m1_bits(top) * E2M1_FIX


@triton.jit
def _e8m0_to_f32(e):
    """int32 holding an E8M0 byte -> 2**(e - 127) in float32 (e = 0: the subnormal 2**-127; 255: inf)."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
