"""A checkpoint's ``quantization_config`` (config.json) -> the format its experts are stored in.

``checkpoint_expert_format(qc, source)`` recognises the layouts the service loads (proto/expert_format.py's
formats) and refuses every other one with an error naming what it read; a config.json without
``quantization_config`` stores float experts ("bf16" format: the checkpoint dtype, unquantized).

| quant_method         | what it says                                                       | format      |
|----------------------|--------------------------------------------------------------------|-------------|
| fp8                  | ``weight_block_size: [128, 128]`` (DeepSeek-V3, Qwen3-*-FP8)        | fp8         |
| mxfp4                | gpt-oss ``_blocks`` / ``_scales``                                  | mxfp4       |
| gptq                 | ``bits: 4``, ``group_size`` 32 / 64 / 128                          | int4-g<G>   |
| compressed-tensors   | one weight scheme: int 4-bit ``strategy: group`` (pack-quantized); | int4-g<G>   |
|                      | float 4-bit groups of 16 (nvfp4-pack-quantized);                   | nvfp4       |
|                      | float 8-bit ``strategy: block`` 128x128                            | fp8         |
| modelopt             | ``quant_algo: NVFP4`` (groups of 16)                               | nvfp4       |

Details the experts' loader checks against the tensors themselves (act-order ``g_idx``, zero points, scale
shapes, formats mixed across experts) belong to gpu_worker/models/quant_checkpoint.py.
"""
from __future__ import annotations

from typing import Any

from proto.expert_format import FP8_BLOCK, ExpertFormat, FormatError

BF16 = ExpertFormat("bf16")


def _refuse(source: str, what: str) -> FormatError:
    return FormatError(f"{source}: quantization_config {what} is not a format this service loads (fp8 with "
                       f"128x128 blocks, GPTQ / compressed-tensors int4 groups of 32/64/128, MXFP4, NVFP4); "
                       f"use a bf16 checkpoint (and --expert-format to quantize it while loading)")


def _int4(group: Any, source: str, what: str) -> ExpertFormat:
    try:
        return ExpertFormat("int4", int(group))
    except (TypeError, ValueError):
        raise _refuse(source, f"{what} with group_size {group!r}") from None


def _compressed_tensors(qc: dict[str, Any], source: str) -> ExpertFormat:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(source, "compressed-tensors without config_groups")
    found: set[ExpertFormat] = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        gsize, block = w.get("group_size"), w.get("block_structure")
        what = f"group {name!r} (num_bits {bits}, type {kind}, strategy {strategy}, group_size {gsize})"
        if bits == 4 and kind == "int" and strategy == "group":
            found.add(_int4(gsize, source, what))
        elif bits == 4 and kind == "float" and strategy in ("tensor_group", "group") and gsize == 16:
            found.add(ExpertFormat("nvfp4"))
        elif bits == 8 and kind == "float" and strategy == "block" and list(block or []) == [FP8_BLOCK, FP8_BLOCK]:
            found.add(ExpertFormat("fp8"))
        else:
            raise _refuse(source, f"compressed-tensors {what}")
    if len(found) > 1:
        raise FormatError(f"{source}: quantization_config mixes formats across its config_groups "
                          f"({', '.join(sorted(f.label for f in found))}); the expert store holds one format")
    return found.pop()


def checkpoint_expert_format(qc: dict[str, Any] | None, source: str = "config.json") -> ExpertFormat:
    """The experts' on-disk format from a config.json's quantization_config (None / {}: bf16, i.e. float)."""
    if not qc:
        return BF16
    if not isinstance(qc, dict):
        raise _refuse(source, f"{qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if list(block or []) != [FP8_BLOCK, FP8_BLOCK]:
            raise _refuse(source, f"fp8 with weight_block_size {block!r} (only [128, 128] blocks)")
        return ExpertFormat("fp8")
    if method == "mxfp4":
        return ExpertFormat("mxfp4")
    if method == "gptq":
        if int(qc.get("bits", 0)) != 4:
            raise _refuse(source, f"gptq with bits {qc.get('bits')!r} (only 4)")
        return _int4(qc.get("group_size"), source, "gptq")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise _refuse(source, f"modelopt quant_algo {qc.get('quant_algo')!r} (only NVFP4)")
        return ExpertFormat("nvfp4")
    raise _refuse(source, f"quant_method {qc.get('quant_method')!r}")


def resolve_served_format(checkpoint: ExpertFormat, requested: str | ExpertFormat | None) -> ExpertFormat:
    """The format the experts are served in: ``requested`` (an --expert-format label; auto / None: the
    checkpoint's). A float checkpoint takes any format (quantized while loading); a quantized one is served as
    it is or dequantized to bf16, never quantized to another format (that would round twice)."""
    if requested is None or (isinstance(requested, str) and requested.strip().lower() in ("", "auto")):
        return checkpoint
    want = requested if isinstance(requested, ExpertFormat) else ExpertFormat.parse(requested)
    if checkpoint.quantized and want.quantized and want != checkpoint:
        raise FormatError(f"the checkpoint's experts are {checkpoint.label}; --expert-format {want.label} would "
                          f"quantize them a second time: serve them as {checkpoint.label} (--expert-format auto) "
                          f"or dequantized (--expert-format bf16)")
    return want
