"""One quantized matrix as a published checkpoint stores it -> `kernels.expert_reference.QuantMatrix`, exactly.

Every function takes the tensors of one matrix ``[rows, K]`` (Hugging Face ``[out, in]``) as read from
safetensors and returns the codes, scales and zero points of our format (proto/expert_format.py) such
that ``dequantize_matrix`` equals the checkpoint format's own float32 dequantization bit for bit (the
one exception, compressed-tensors NVFP4, is stated below). ``where`` names the file and the tensor
prefix in error messages. The conventions, each checked against the library or the published code:

FP8 block (DeepSeek-V3, Qwen3-*-FP8; transformers ``finegrained_fp8``): ``weight`` float8_e4m3fn
  ``[rows, K]``, ``weight_scale_inv`` float32 ``[ceil(rows/128), ceil(K/128)]`` (despite the name, a
  multiplier): ``w = fp32(weight) * scale_inv[r // 128, k // 128]``. Scales stored as bf16/fp16 or
  float8_e8m0fnu (``scale_fmt: ue8m0``) widen to float32 exactly. Codes are the fp8 bytes unchanged.

compressed-tensors ``pack-quantized`` (W4A16; ``PackedQuantizationCompressor``): ``weight_packed``
  int32 ``[rows, K/8]``, element k in word k // 8 at bits 4 * (k % 8), stored as q + 8 (q signed
  -8..7); read as little-endian bytes that is our nibble order (even k low), so the codes are the
  words' bytes and u = q + 8. ``weight_scale`` ``[rows, K/G]`` (the model dtype). Asymmetric:
  ``weight_zero_point`` int32 ``[ceil(rows/8), K/G]`` packed the same way along rows (``packed_dim=0``),
  also + 8: zero = zp + 8; symmetric: zero = 8. ``w = (q - zp) * scale = (u - zero) * scale``.
  ``weight_shape`` holds ``[rows, K]``. The library computes in the scale's dtype; with float32
  scales it equals ours bit for bit, and its bf16 result is ours rounded to bf16 (the product of a
  4-bit integer and a bf16 scale is exact in float32).

GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K/8, rows]`` (input k in word row k // 8, bits
  4 * (k % 8)), ``qzeros`` int32 ``[K/G, rows/8]`` (output r in word column r // 8, bits 4 * (r % 8)),
  ``scales`` fp16 ``[K/G, rows]``, ``g_idx`` int32 ``[K]``: ``w[r, k] = scales[g, r] * (q - z[g, r])``
  with ``g = g_idx[k]``. ``checkpoint_format: gptq`` (v1, the default) stores z - 1 (the historic
  off-by-one, so a stored 15 means 16 after the wrap of -1); ``gptq_v2`` stores z. Our zero is a
  byte, so it holds 16. Act-order (``desc_act`` with a ``g_idx`` that is not ``k // G``) is refused:
  our groups are G consecutive inputs, and gate/up share the hidden input across experts, so their
  columns cannot be permuted per expert.

MXFP4 (gpt-oss; transformers ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``):
  ``*_blocks`` uint8 ``[..., rows, K/32, 16]``, element k in byte k // 2 of its row, low nibble for
  even k; ``*_scales`` uint8 E8M0 ``[..., rows, K/32]``: ``w = fp4 * 2**(scale - 127)`` (``ldexp``).
  gpt-oss stores experts fused: ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` with gate and up rows
  INTERLEAVED (row 2i is gate row i, row 2i+1 up row i: its forward takes ``[..., ::2]`` and
  ``[..., 1::2]``), ``down_proj_blocks`` ``[E, H, I/32, 16]``.

NVFP4, ModelOpt (``NVFP4QTensor``; ``quant_method: modelopt``, ``quant_algo: NVFP4``): ``weight``
  uint8 ``[rows, K/2]`` (even k in the low nibble: ``(q[1::2] << 4) | q[0::2]``), ``weight_scale``
  float8_e4m3fn ``[rows, K/16]``, ``weight_scale_2`` float32 scalar:
  ``w = fp4 * fp32(e4m3(s) * weight_scale_2)``: our formula, global = ``weight_scale_2``.

NVFP4, compressed-tensors (``nvfp4-pack-quantized``): ``weight_packed`` uint8 ``[rows, K/2]`` (low
  nibble first), ``weight_scale`` float8_e4m3fn ``[rows, K/16]``, ``weight_global_scale`` float32
  ``[1]`` = 448 * 6 / amax: the RECIPROCAL of ModelOpt's. Our global is fp32(1 / weight_global_scale):
  exact against the multiply-by-reciprocal that serving engines use (vLLM's
  ``weight_scale_2 = 1 / weight_global_scale``); the library's own reference divides
  (``scale / global_scale``): for most global scales some block scales differ by one float32 ulp, so
  weights by at most two ulps (exact when the global scale is a power of two).
"""
from __future__ import annotations

import sys

import torch

from ftexpert.proto.expert_format import FP8_BLOCK
from ftexpert.kernels.expert_reference import QuantMatrix

from ftexpert.gpu_worker.checkpoint.reader import CheckpointError

if sys.byteorder != "little":    # the int32 words are reinterpreted as bytes below
    raise ImportError("quantized checkpoints are read on little-endian hosts only")

FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)     # 8 nibbles of an int32, lowest first


class QuantCheckpointError(CheckpointError):
    """A quantized checkpoint whose config or tensors this service cannot read exactly."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def expect(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], where: str,
           what: str, hint: str = "") -> None:
    """Raise naming ``where`` (file: tensor prefix) unless ``t`` has ``shape`` and one of ``dtypes``."""
    if tuple(t.shape) != tuple(shape):
        raise QuantCheckpointError(f"{where}{what} has shape {tuple(t.shape)}, expected {tuple(shape)}"
                                   f"{hint}; the checkpoint's tensors do not match its quantization_config")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise QuantCheckpointError(f"{where}{what} is {str(t.dtype).replace('torch.', '')}, expected {names}")


def group_hint(scale: torch.Tensor, k: int, group: int) -> str:
    """' (scales for group size 64, the config says 128)' when a scale tensor implies another group."""
    if scale.dim() == 2 and scale.shape[-1] and k % scale.shape[-1] == 0 and k // scale.shape[-1] != group:
        return (f" (scales for group size {k // scale.shape[-1]}, the config says {group}: a checkpoint "
                f"mixing group sizes is not supported)")
    return ""


def check_group(k: int, group: int, where: str) -> None:
    if k % group:
        raise QuantCheckpointError(f"{where}: group size {group} does not divide the input dimension {k}; "
                                   f"the checkpoint cannot be read in groups of {group}")


def dense(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with row-major strides even in size-1 dims (``view(dtype)`` checks the last stride)."""
    return t.contiguous().reshape(-1).view(t.shape)


def _float_scales(scale: torch.Tensor) -> torch.Tensor:
    return dense(scale.float())               # bf16 / fp16 / e8m0 -> float32 is exact


def _words_as_nibble_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, K/8] (element k at bits 4*(k%8) of word k//8) -> uint8 [rows, K/2], even k low."""
    return dense(words).view(torch.uint8)


def _unpack_nibbles_of_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> int32 [..., 8n]: nibble i of word j is element 8j + i."""
    return ((words.unsqueeze(-1) >> NIBBLE_SHIFTS.to(words.device)) & 0xF).flatten(-2)


# -- FP8 ---------------------------------------------------------------------------------------------
def fp8_block_matrix(weight: torch.Tensor, scale_inv: torch.Tensor, where: str) -> QuantMatrix:
    if weight.dim() != 2:
        raise QuantCheckpointError(f"{where}weight has shape {tuple(weight.shape)}, expected a matrix")
    rows, k = weight.shape
    expect(weight, (rows, k), (torch.float8_e4m3fn,), where, "weight",
           " (fp8 checkpoints store weights as float8_e4m3fn)")
    e8m0 = (getattr(torch, "float8_e8m0fnu", None),)
    expect(scale_inv, (_ceil(rows, FP8_BLOCK), _ceil(k, FP8_BLOCK)), FLOAT_SCALE_DTYPES + e8m0, where,
           "weight_scale_inv", f" (one scale per {FP8_BLOCK}x{FP8_BLOCK} block of [{rows}, {k}])")
    return QuantMatrix(dense(weight).view(torch.uint8), _float_scales(scale_inv))


# -- INT4 --------------------------------------------------------------------------------------------
def ct_int4_matrix(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                   rows: int, k: int, group: int, symmetric: bool, where: str) -> QuantMatrix:
    """compressed-tensors pack-quantized, 4 bits, group strategy."""
    check_group(k, group, where)
    expect(packed, (rows, k // 8), (torch.int32,), where, "weight_packed", " (8 int4 weights per int32)")
    expect(scale, (rows, k // group), FLOAT_SCALE_DTYPES, where, "weight_scale", group_hint(scale, k, group))
    if symmetric:
        if zero_point is not None and bool(zero_point.ne(0).any()):
            raise QuantCheckpointError(f"{where}weight_zero_point is not zero but the config says "
                                       f"symmetric: true; fix the config's symmetric flag")
        zeros = torch.full((rows, k // group), 8, dtype=torch.uint8)
    else:
        if zero_point is None:
            raise QuantCheckpointError(f"{where}weight_zero_point is missing; the config says symmetric: "
                                       f"false (asymmetric int4 needs zero points)")
        expect(zero_point, (_ceil(rows, 8), k // group), (torch.int32,), where, "weight_zero_point",
               " (zero points packed 8 per int32 along the output dimension)")
        zeros = dense(_unpack_nibbles_of_words(zero_point.t()).t()[:rows].to(torch.uint8))
    return QuantMatrix(_words_as_nibble_bytes(packed), _float_scales(scale), zeros)


def gptq_matrix(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, v1: bool, where: str) -> QuantMatrix:
    """GPTQ 4-bit: qweight [K/8, rows], qzeros [K/G, rows/8], scales [K/G, rows], g_idx [K]."""
    if qweight.dim() != 2:
        raise QuantCheckpointError(f"{where}qweight has shape {tuple(qweight.shape)}, expected [K/8, rows]")
    k, rows = qweight.shape[0] * 8, qweight.shape[1]
    check_group(k, group, where)
    expect(qweight, (k // 8, rows), (torch.int32,), where, "qweight", " (8 int4 weights per int32)")
    expect(scales, (k // group, rows), FLOAT_SCALE_DTYPES, where, "scales",
           group_hint(scales.t(), k, group) if scales.dim() == 2 else "")
    expect(qzeros, (k // group, _ceil(rows, 8)), (torch.int32,), where, "qzeros",
           " (zero points packed 8 per int32 along the output dimension)")
    if g_idx is not None:
        expect(g_idx, (k,), (torch.int32, torch.int64), where, "g_idx")
        if not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise QuantCheckpointError(
                f"{where}g_idx is not in input order: this is an act-order (desc_act) GPTQ checkpoint, "
                f"which is not supported (the expert formats group {group} consecutive inputs); use a "
                f"checkpoint quantized with desc_act=false, or the bf16 checkpoint with --expert-format int4")
    zeros = _unpack_nibbles_of_words(qzeros)[:, :rows] + (1 if v1 else 0)
    return QuantMatrix(_words_as_nibble_bytes(qweight.t()), _float_scales(scales.t()),
                       dense(zeros.t().to(torch.uint8)))


# -- FP4 ---------------------------------------------------------------------------------------------
def mxfp4_matrix(blocks: torch.Tensor, scales: torch.Tensor, rows: int, k: int, where: str,
                 names: tuple[str, str] = ("_blocks", "_scales")) -> QuantMatrix:
    """gpt-oss MXFP4: blocks [rows, K/32, 16] uint8, scales [rows, K/32] uint8 (E8M0)."""
    check_group(k, 32, where)
    expect(blocks, (rows, k // 32, 16), (torch.uint8,), where, names[0], " (32 fp4 weights in 16 bytes)")
    expect(scales, (rows, k // 32), (torch.uint8,), where, names[1], " (one E8M0 byte per 32 weights)")
    return QuantMatrix(dense(blocks.reshape(rows, k // 2)), dense(scales))


def mxfp4_gate_up(blocks: torch.Tensor, scales: torch.Tensor, intermediate: int, hidden: int,
                  where: str) -> tuple[QuantMatrix, QuantMatrix]:
    """One expert's gpt-oss ``gate_up_proj`` [2I, ...], rows interleaved: (gate, up)."""
    both = mxfp4_matrix(blocks, scales, 2 * intermediate, hidden, where,
                        ("gate_up_proj_blocks", "gate_up_proj_scales"))
    return (QuantMatrix(dense(both.codes[0::2]), dense(both.scales[0::2])),
            QuantMatrix(dense(both.codes[1::2]), dense(both.scales[1::2])))


def nvfp4_matrix(packed: torch.Tensor, scale: torch.Tensor, global_scale: float, rows: int, k: int,
                 where: str, names: tuple[str, str]) -> QuantMatrix:
    check_group(k, 16, where)
    expect(packed, (rows, k // 2), (torch.uint8,), where, names[0], " (two fp4 weights a byte)")
    expect(scale, (rows, k // 16), (torch.float8_e4m3fn,), where, names[1], group_hint(scale, k, 16))
    return QuantMatrix(dense(packed), dense(scale).view(torch.uint8), None, global_scale)


def scalar_f32(t: torch.Tensor, where: str, what: str) -> torch.Tensor:
    if t.numel() != 1 or t.dtype != torch.float32:
        raise QuantCheckpointError(f"{where}{what} is {t.dtype} of shape {tuple(t.shape)}, expected one "
                                   f"float32 (a per-tensor scale)")
    return t.reshape(())


def modelopt_nvfp4_matrix(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, rows: int, k: int,
                          where: str) -> QuantMatrix:
    glob = float(scalar_f32(scale_2, where, "weight_scale_2"))
    return nvfp4_matrix(weight, scale, glob, rows, k, where, ("weight", "weight_scale"))


def ct_nvfp4_matrix(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, rows: int, k: int,
                    where: str) -> QuantMatrix:
    gs = scalar_f32(global_scale, where, "weight_global_scale")
    if not bool(gs > 0) or not bool(torch.isfinite(gs)):
        raise QuantCheckpointError(f"{where}weight_global_scale is {float(gs)}; it must be positive and finite")
    glob = float(torch.reciprocal(gs))       # float32 reciprocal, see the module docstring
    return nvfp4_matrix(packed, scale, glob, rows, k, where, ("weight_packed", "weight_scale"))
