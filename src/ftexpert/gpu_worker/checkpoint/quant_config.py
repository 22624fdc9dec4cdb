"""A checkpoint's ``quantization_config`` (config.json) -> which on-disk scheme its experts use.

Recognised exactly (anything else is refused with the list below, never read as bf16):

| quant_method         | config                                                          | experts |
|----------------------|-----------------------------------------------------------------|---------|
| fp8                  | fmt e4m3, weight_block_size [128, 128] (DeepSeek-V3, Qwen3-FP8)  | fp8     |
| compressed-tensors   | format pack-quantized; weights num_bits 4, type int, strategy    | int4-gG |
|                      | group, group_size 32/64/128, symmetric true/false                |         |
| compressed-tensors   | format nvfp4-pack-quantized; weights 4-bit float, group 16       | nvfp4   |
| gptq                 | bits 4, group_size 32/64/128, checkpoint_format gptq / gptq_v2   | int4-gG |
| mxfp4                | gpt-oss ``*_blocks`` / ``*_scales``                              | mxfp4   |
| modelopt             | quant_algo NVFP4 (group 16)                                      | nvfp4   |

Activations stay in the model dtype: the experts are served weight-only, as vLLM's Marlin kernels run
FP8 and NVFP4 checkpoints on GPUs without FP8/FP4 activations; activation scales (``input_scale``,
``input_global_scale``, ``activation_scheme``) are not read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftexpert.proto.expert_format import INT4_GROUPS, ExpertFormat, FormatError

from ftexpert.gpu_worker.checkpoint.quant_tensors import QuantCheckpointError

SCHEMES = ("fp8-block", "ct-int4", "gptq", "mxfp4", "modelopt-nvfp4", "ct-nvfp4", "ct-other")
SUPPORTED = ("fp8 (weight_block_size [128, 128]), compressed-tensors pack-quantized (int4 group) or "
             "nvfp4-pack-quantized, gptq (4 bits), mxfp4 (gpt-oss), modelopt NVFP4")


@dataclass(frozen=True)
class CheckpointQuant:
    """How a quantized checkpoint stores its weights."""
    scheme: str                 # one of SCHEMES
    fmt: ExpertFormat           # the experts' format (bf16 when the config leaves the experts unquantized)
    symmetric: bool = True      # int4: no stored zero points
    gptq_v1: bool = False       # gptq: zero points stored minus one (checkpoint_format "gptq")


def _err(source: str, msg: str) -> QuantCheckpointError:
    return QuantCheckpointError(f"{source}: quantization_config {msg}")


def _expert_module_names(config_json: dict[str, Any]) -> list[str]:
    """One expert's three projection modules, named as the hub stores them (layer 0, expert 0)."""
    if "MixtralForCausalLM" in (config_json.get("architectures") or []):
        return [f"model.layers.0.block_sparse_moe.experts.0.{p}" for p in ("w1", "w3", "w2")]
    return [f"model.layers.0.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


def ct_target_matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` regex (re.match), an exact module name, or a Linear class name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or ("." not in target and target.endswith("Linear"))


def _parse_fp8(qc: dict[str, Any], source: str) -> CheckpointQuant:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _err(source, f"fp8 fmt {qc.get('fmt')!r} is not supported; only e4m3 checkpoints are read")
    block = qc.get("weight_block_size")
    if block is None:
        raise _err(source, "fp8 without weight_block_size (per-tensor FP8) is not supported; the fp8 expert "
                           "format has 128x128 block scales (DeepSeek-V3 / Qwen3-*-FP8 checkpoints)")
    if list(block) != [128, 128]:
        raise _err(source, f"fp8 weight_block_size {list(block)} is not supported; only [128, 128]")
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise _err(source, f"fp8 scale_fmt {qc.get('scale_fmt')!r} is not supported (float or ue8m0)")
    return CheckpointQuant("fp8-block", ExpertFormat("fp8"))


def _int4_group(group: Any, source: str, what: str) -> int:
    if group not in INT4_GROUPS:
        raise _err(source, f"{what} group_size {group} is not supported; int4 experts need group size "
                           f"{', '.join(map(str, INT4_GROUPS))} (per-channel -1 is not supported)")
    return int(group)


def _parse_gptq(qc: dict[str, Any], source: str) -> CheckpointQuant:
    if qc.get("bits") != 4:
        raise _err(source, f"gptq bits {qc.get('bits')} is not supported; only 4-bit GPTQ is read")
    group = _int4_group(qc.get("group_size"), source, "gptq")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _err(source, f"gptq checkpoint_format {fmt!r} is not supported; use gptq or gptq_v2 files")
    if qc.get("dynamic"):
        raise _err(source, "gptq with per-module 'dynamic' overrides is not supported")
    if qc.get("pack_dtype", "int32") != "int32":
        raise _err(source, f"gptq pack_dtype {qc.get('pack_dtype')!r} is not supported (int32 only)")
    return CheckpointQuant("gptq", ExpertFormat("int4", group), symmetric=bool(qc.get("sym", True)),
                           gptq_v1=fmt == "gptq")


def _parse_ct(qc: dict[str, Any], config_json: dict[str, Any], source: str) -> CheckpointQuant:
    groups = qc.get("config_groups") or {}
    ignore = qc.get("ignore") or []
    experts = _expert_module_names(config_json)
    found: dict[str, tuple[str, dict[str, Any]]] = {}    # expert module -> (group name, group)
    for gname, group in groups.items():
        for module in experts:
            if any(ct_target_matches(module, t) for t in group.get("targets") or []):
                found.setdefault(module, (gname, group))
    ignored = [m for m in experts if any(ct_target_matches(m, t) for t in ignore)]
    quantized = [m for m in experts if m in found and m not in ignored]
    if not quantized:
        scheme = {"pack-quantized": "ct-int4", "nvfp4-pack-quantized": "ct-nvfp4"}.get(qc.get("format"), "ct-other")
        return CheckpointQuant(scheme, ExpertFormat("bf16"))   # experts unquantized; dense weights read per tensor
    if len(quantized) != len(experts):
        raise _err(source, f"quantizes {quantized} but not {sorted(set(experts) - set(quantized))}: a "
                           f"checkpoint mixing quantized and unquantized expert projections is not supported")
    chosen = {json.dumps(found[m][1].get("weights"), sort_keys=True) for m in quantized}
    if len(chosen) > 1:
        raise _err(source, f"config_groups {sorted({found[m][0] for m in quantized})} quantize one expert's "
                           f"projections differently; a checkpoint mixing formats is not supported")
    gname, group = found[quantized[0]]
    fmt = group.get("format") or qc.get("format")
    w = group.get("weights") or {}
    where = f"compressed-tensors config_groups.{gname}"
    if fmt == "pack-quantized":
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group"):
            raise _err(source, f"{where}: weights num_bits={w.get('num_bits')} type={w.get('type')} "
                               f"strategy={w.get('strategy')} are not supported; pack-quantized experts must "
                               f"be num_bits 4, type int, strategy group")
        if w.get("actorder") == "group":
            raise _err(source, f"{where}: actorder 'group' (columns regrouped by activation order) is not "
                               f"supported; use a checkpoint quantized with actorder null or 'weight'")
        g = _int4_group(w.get("group_size"), source, where)
        return CheckpointQuant("ct-int4", ExpertFormat("int4", g), symmetric=bool(w.get("symmetric", True)))
    if fmt == "nvfp4-pack-quantized":
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise _err(source, f"{where}: nvfp4-pack-quantized weights must be num_bits 4, type float, "
                               f"group_size 16 (got {w.get('num_bits')}, {w.get('type')}, {w.get('group_size')})")
        if not w.get("symmetric", True):
            raise _err(source, f"{where}: asymmetric NVFP4 is not supported")
        return CheckpointQuant("ct-nvfp4", ExpertFormat("nvfp4"))
    raise _err(source, f"compressed-tensors format {fmt!r} is not supported; supported: pack-quantized "
                       f"(int4 group) and nvfp4-pack-quantized")


def _parse_modelopt(qc: dict[str, Any], source: str) -> CheckpointQuant:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise _err(source, f"modelopt quant_algo {inner.get('quant_algo')!r} is not supported; only NVFP4")
    if inner.get("group_size", 16) != 16:
        raise _err(source, f"modelopt NVFP4 group_size {inner.get('group_size')} is not supported (16)")
    return CheckpointQuant("modelopt-nvfp4", ExpertFormat("nvfp4"))


def parse_quant_config(config_json: dict[str, Any], source: str = "config.json") -> CheckpointQuant | None:
    """The checkpoint's quantization scheme, or None when config.json has no quantization_config."""
    qc = config_json.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _err(source, f"is {type(qc).__name__}, expected an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _parse_fp8(qc, source)
    if method == "gptq":
        return _parse_gptq(qc, source)
    if method == "compressed-tensors":
        return _parse_ct(qc, config_json, source)
    if method == "mxfp4":
        return CheckpointQuant("mxfp4", ExpertFormat("mxfp4"))
    if method == "modelopt":
        return _parse_modelopt(qc, source)
    raise _err(source, f"quant_method {qc.get('quant_method')!r} is not supported; supported: {SUPPORTED}. "
                       f"Use the checkpoint's bf16 release (and --expert-format to quantize at load)")


def detect_quant_format(config_json: dict[str, Any]) -> ExpertFormat | None:
    """The experts' format of a checkpoint, from its config.json; None when it is not quantized.

    Raises `QuantCheckpointError` for a quantization_config this service cannot read."""
    quant = parse_quant_config(config_json)
    return None if quant is None else quant.fmt


def read_checkpoint_quant(model_dir: str | Path) -> CheckpointQuant | None:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantCheckpointError(f"cannot read {path} ({exc}); the checkpoint needs its config.json") from None
    return parse_quant_config(raw, source=str(path))


BF16 = ExpertFormat("bf16")


def checkpoint_expert_format(qc: dict[str, Any] | None, source: str = "config.json") -> ExpertFormat:
    """The experts' on-disk format from a config.json's quantization_config (None / {}: bf16, i.e. float);
    refuses (QuantCheckpointError) a quantization this service does not load."""
    if not qc:
        return BF16
    quant = parse_quant_config({"quantization_config": qc}, source=source)
    return BF16 if quant is None else quant.fmt


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
