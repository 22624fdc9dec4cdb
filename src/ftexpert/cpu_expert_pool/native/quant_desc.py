"""The quantized expert kernel's view of a format (quant_ffn.c's ``ft_quant_format``) and its ctypes bindings.

``quant_format_desc(layout)`` turns a ``proto.expert_format.QuantLayout`` into the struct the C code reads: the
format id, the group size, each region's byte offset within one expert (-1 where the format has none) and whether
the activations are quantized to int8 (``act_int8``: 4-bit formats on AVX-512 VNNI, native/quant_int8.h). The C
side takes the region shapes from H, I and the format by proto/expert_format.py's formulas and checks that every
region fits ``expert_bytes`` (ERR_BAD_FORMAT otherwise), so a layout change there fails loudly here.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ftexpert.cpu_expert_pool.native.act_desc import ExpertActDesc, act_address
from ftexpert.cpu_expert_pool.native.errors import ERRORS
from ftexpert.proto.expert_format import FP8_BLOCK, FormatError, QuantLayout

FORMAT_IDS = {"fp8": 1, "int4": 2, "mxfp4": 3, "nvfp4": 4}     # quant_dots.h FMT_*
REGIONS = ("codes_w13", "codes_w2", "scales_w13", "scales_w2", "zeros_w13", "zeros_w2", "globals")
MATRICES = {"gate": 0, "up": 1, "down": 2}                      # ft_dequantize_rows's m
INT8_FORMATS = ("int4", "mxfp4", "nvfp4")                       # quant_int8.h's formats
PH_MAX_THREADS, PH_MARKS = 256, 8                               # phase_times.h: threads stamped, marks a thread


class QuantFormatDesc(ctypes.Structure):
    """Mirror of quant_ffn.c's ft_quant_format (all int64)."""
    _fields_ = [("format", ctypes.c_int64), ("group_size", ctypes.c_int64), ("expert_bytes", ctypes.c_int64),
                *((name, ctypes.c_int64) for name in REGIONS), ("act_int8", ctypes.c_int64)]


def quant_format_desc(layout: QuantLayout, act_int8: bool = False) -> QuantFormatDesc:
    """The struct for one expert of ``layout`` (keep it alive while C holds its address); act_int8: the int8
    activation path (4-bit formats only; the C side refuses it on a CPU without AVX-512 VNNI)."""
    fmt = layout.fmt
    if fmt.name not in FORMAT_IDS:
        raise FormatError(f"the compiled CPU expert kernel has no {fmt.label} path; it reads "
                          f"{', '.join(FORMAT_IDS)} (and bf16 through ft_moe_layer)")
    if act_int8 and fmt.name not in INT8_FORMATS:
        raise FormatError(f"int8 activations are for the 4-bit formats ({', '.join(INT8_FORMATS)}), not {fmt.label}")
    regions = layout.regions
    return QuantFormatDesc(FORMAT_IDS[fmt.name], FP8_BLOCK if fmt.name == "fp8" else fmt.group_size,
                           layout.expert_nbytes, *(regions[name][0] if name in regions else -1 for name in REGIONS),
                           int(act_int8))


class QuantBindings:
    """ft_moe_layer_q and ft_dequantize_rows of a loaded library (the kernel's, or a test build of quant_ffn.c)."""

    def __init__(self, lib: ctypes.CDLL):
        c_int, c_i64, c_p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.ft_moe_layer_q.restype = c_int
        lib.ft_moe_layer_q.argtypes = [c_p, c_int, c_int, c_p, c_i64, c_int, c_int, c_int, c_p, c_int, c_int,
                                       c_p, c_p, c_p, c_int, c_p, c_p, c_int, c_int, c_p]
        lib.ft_dequantize_rows.restype = c_int
        lib.ft_dequantize_rows.argtypes = [c_p, c_int, c_p, c_int, c_int, c_int, c_int, c_int, c_p]
        lib.ft_quant_int8_available.restype = c_int
        lib.ft_quant_int8_available.argtypes = []
        lib.ft_quant_dot_i8.restype = c_int
        lib.ft_quant_dot_i8.argtypes = [c_p, c_p, c_int, c_int, c_int, c_int, c_int, c_p, c_int, c_p]
        lib.ft_quant_phase_times.restype = c_int
        lib.ft_quant_phase_times.argtypes = [c_p, c_int]
        lib.ft_quant_q8_rows.restype = c_i64
        lib.ft_quant_q8_rows.argtypes = [c_p, c_int, c_int, c_int, c_int, c_int, c_p]
        self._lib = lib
        self.int8_available = bool(lib.ft_quant_int8_available())     # AVX-512 VNNI here
        self._stats = (ctypes.c_int64 * 2)()

    def moe_layer(self, desc: QuantFormatDesc, isa: int, num_threads: int, layer_base: int, expert_stride_bytes: int,
                  num_experts: int, hidden_size: int, intermediate: int, hidden_ptr: int, hidden_is_bf16: bool,
                  num_tokens: int, tok_ptr: int, expert_ptr: int, weight_ptr: int, num_triples: int, out_ptr: int,
                  split_expert: int = -1, split_limit: int = 0,
                  act: ExpertActDesc | None = None) -> tuple[int, int]:
        """NativeLib.moe_layer for a quantized store; returns (experts used, bytes read)."""
        rc = self._lib.ft_moe_layer_q(ctypes.addressof(desc), isa, num_threads, layer_base, expert_stride_bytes,
                                      num_experts, hidden_size, intermediate, hidden_ptr, int(hidden_is_bf16),
                                      num_tokens, tok_ptr, expert_ptr, weight_ptr, num_triples, out_ptr,
                                      ctypes.addressof(self._stats), split_expert, split_limit, act_address(act))
        if rc != 0:
            raise ValueError(f"CPU expert kernel: {ERRORS.get(rc, f'error {rc}')}")
        return int(self._stats[0]), int(self._stats[1])

    def dequantize_rows(self, desc: QuantFormatDesc, isa: int, expert_ptr: int, hidden_size: int, intermediate: int,
                        matrix: str, row0: int, num_rows: int, out_ptr: int) -> None:
        """Rows [row0, row0 + num_rows) of gate / up / down, fp32 in element order, by `isa`'s decoders."""
        rc = self._lib.ft_dequantize_rows(ctypes.addressof(desc), isa, expert_ptr, hidden_size, intermediate,
                                          MATRICES[matrix], row0, num_rows, out_ptr)
        if rc != 0:
            raise ValueError(f"ft_dequantize_rows: {ERRORS.get(rc, f'error {rc}')}")

    def dot_i8(self, desc: QuantFormatDesc, expert_ptr: int, hidden_size: int, intermediate: int, matrix: str,
               row0: int, num_rows: int, x_ptr: int, batch: int, out_ptr: int) -> None:
        """The int8 path's dot products (a test hook): out [batch, num_rows] = rows [row0, row0 + num_rows) of
        gate / up / down . x [batch, K] fp32, x quantized as the layer quantizes it."""
        rc = self._lib.ft_quant_dot_i8(ctypes.addressof(desc), expert_ptr, hidden_size, intermediate,
                                       MATRICES[matrix], row0, num_rows, x_ptr, batch, out_ptr)
        if rc != 0:
            raise ValueError(f"ft_quant_dot_i8: {ERRORS.get(rc, f'error {rc}')}")

    def q8_rows(self, fmt: str, group_size: int, x: np.ndarray, plain: bool) -> np.ndarray:
        """The int8 path's quantized activations (a test hook): x [batch, K] fp32 -> [batch, row bytes] uint8, by
        the layer's quantizer or (plain) by its value-by-value reference."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        batch, K = x.shape
        row = self._lib.ft_quant_q8_rows(None, K, FORMAT_IDS[fmt], group_size, 0, int(plain), None)
        out = np.zeros((batch, max(row, 0)), dtype=np.uint8)
        rc = row if row < 0 else self._lib.ft_quant_q8_rows(x.ctypes.data, K, FORMAT_IDS[fmt], group_size, batch,
                                                            int(plain), out.ctypes.data)
        if rc < 0:
            raise ValueError(f"ft_quant_q8_rows: {ERRORS.get(int(rc), f'error {rc}')}")
        return out

    def phase_times(self) -> tuple[int, int, np.ndarray] | None:
        """The last moe_layer call's stamps in a build with -DFT_PHASE_TIMES (native/phase_times.h): (call entry ns,
        call exit ns, marks [threads, 8] ns); None in any other build."""
        buf = np.zeros(3 + PH_MAX_THREADS * PH_MARKS, dtype=np.int64)
        n = self._lib.ft_quant_phase_times(buf.ctypes.data, buf.size)
        if n < 0:
            return None
        threads = int(buf[2])
        return int(buf[0]), int(buf[1]), buf[3:3 + threads * PH_MARKS].reshape(threads, PH_MARKS).copy()
