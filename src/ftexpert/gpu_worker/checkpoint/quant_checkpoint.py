"""Quantized checkpoints as they are published -> our expert format (proto/expert_format.py).

- `QuantCheckpointExpertSource(reader, cfg, fmt)`: the `ExpertSource` of a quantized checkpoint. It
  fills ``out: [E, expert_nbytes] uint8`` (a layer of the shared expert store, any row stride) with
  each expert's bytes via ``pack_expert``; the conversion is exact (quant_tensors.py states every
  on-disk convention), so ``dequantize_expert`` gives the checkpoint format's own dequantization.
- `dequantize_dense(reader, name)`: one dense weight (attention, router, shared experts) of a
  quantized checkpoint as float32 (the same exact decode); `DequantizingReader` wraps a
  `CheckpointReader` so that ``load_dense_weights`` reads a quantized checkpoint unchanged.
- `detect_quant_format(config_json)` / `parse_quant_config` (quant_config.py): which format.

Experts are read in the hub's per-expert layout (``experts.{j}.gate_proj.weight_packed`` ...) for
fp8, int4 and nvfp4, and in gpt-oss's fused layout (``experts.gate_up_proj_blocks``) for mxfp4.
Each expert must be stored in the config's scheme and group size: an expert stored unquantized or
otherwise (a checkpoint mixing formats) is refused, naming the file and tensor.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ftexpert.proto.expert_format import ExpertFormat, QuantLayout
from ftexpert.kernels.expert_reference import QuantMatrix, dequantize_matrix, pack_expert

from ftexpert.gpu_worker.checkpoint.reader import CheckpointError, CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import expert_act_of
from ftexpert.gpu_worker.checkpoint.gpt_oss_experts import fill_gpt_oss_biases
from ftexpert.gpu_worker.checkpoint.quant_config import (CheckpointQuant, QuantCheckpointError, detect_quant_format, parse_quant_config,
                           read_checkpoint_quant)
from ftexpert.gpu_worker.checkpoint.quant_tensors import (ct_int4_matrix, ct_nvfp4_matrix, fp8_block_matrix, gptq_matrix,
                            modelopt_nvfp4_matrix, mxfp4_gate_up, mxfp4_matrix)
from ftexpert.gpu_worker.checkpoint.weight_names import expert_names, fused_expert_names

__all__ = ["QuantCheckpointExpertSource", "DequantizingReader", "dequantize_dense", "detect_quant_format",
           "parse_quant_config", "read_checkpoint_quant", "read_quant_matrix", "stored_scheme",
           "CheckpointQuant", "QuantCheckpointError"]

SCHEME_LABEL = {"fp8-block": "fp8 block (weight_scale_inv)", "ct-int4": "compressed-tensors pack-quantized",
                "ct-nvfp4": "compressed-tensors nvfp4-pack-quantized", "gptq": "GPTQ (qweight)",
                "modelopt-nvfp4": "ModelOpt NVFP4 (weight_scale_2)", "mxfp4": "MXFP4 (_blocks)"}
INT_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


def stored_scheme(reader: CheckpointReader, prefix: str) -> str | None:
    """The scheme a module's tensors are stored in (``prefix`` ends with '.'); None: a plain weight."""
    if reader.has(prefix + "weight_scale_inv"):
        return "fp8-block"
    if reader.has(prefix + "qweight"):
        return "gptq"
    if reader.has(prefix + "weight_packed"):
        return "ct-nvfp4" if reader.has(prefix + "weight_global_scale") else "ct-int4"
    if reader.has(prefix + "weight_scale_2"):
        return "modelopt-nvfp4"
    return None


def _where(reader: CheckpointReader, prefix: str, first: str) -> str:
    shard = reader.shard_of.get(prefix + first)
    return f"{shard.name if shard is not None else reader.model_dir}: {prefix}"


def read_quant_matrix(reader: CheckpointReader, prefix: str, scheme: str, *, group: int | None = None,
                      symmetric: bool | None = None, gptq_v1: bool = True,
                      shape: tuple[int, int] | None = None) -> tuple[QuantMatrix, ExpertFormat, tuple[int, int]]:
    """One module's matrix (``prefix``: 'model.layers.0.mlp.experts.3.gate_proj.') stored in ``scheme``.

    ``group`` / ``symmetric`` default to what the tensors' shapes imply (dense weights); experts pass
    the config's, so a checkpoint mixing group sizes is refused. ``shape``: the expected [rows, K]."""
    found = stored_scheme(reader, prefix)
    if found != scheme:
        plain = reader.has(prefix + "weight")
        stored = SCHEME_LABEL.get(found, "unquantized (a plain weight)" if plain else "missing")
        raise QuantCheckpointError(
            f"{reader.model_dir}: {prefix}* is {stored}, but the checkpoint's quantization_config says "
            f"{SCHEME_LABEL[scheme]}; a checkpoint mixing formats across experts is not supported")
    get = lambda suffix: reader.get(prefix + suffix)            # noqa: E731
    if scheme == "fp8-block":
        weight = get("weight")
        where = _where(reader, prefix, "weight")
        m, fmt, rows_k = fp8_block_matrix(weight, get("weight_scale_inv"), where), ExpertFormat("fp8"), weight.shape
    elif scheme == "ct-int4":
        where = _where(reader, prefix, "weight_packed")
        dims = get("weight_shape") if reader.has(prefix + "weight_shape") else None
        if dims is None and shape is None:
            raise QuantCheckpointError(f"{where}weight_shape is missing; compressed-tensors stores it beside "
                                       f"weight_packed")
        rows_k = tuple(int(d) for d in dims.tolist()) if dims is not None else shape
        scale = get("weight_scale")
        if group is None:
            group = rows_k[1] // max(1, scale.shape[-1])
        zp = get("weight_zero_point") if reader.has(prefix + "weight_zero_point") else None
        sym = zp is None if symmetric is None else symmetric
        fmt = _int4_format(group, where)
        m = ct_int4_matrix(get("weight_packed"), scale, zp, rows_k[0], rows_k[1], group, sym, where)
    elif scheme == "gptq":
        where = _where(reader, prefix, "qweight")
        qweight, scales = get("qweight"), get("scales")
        rows_k = (qweight.shape[-1], qweight.shape[0] * 8)
        if group is None:
            group = rows_k[1] // max(1, scales.shape[0])
        fmt = _int4_format(group, where)
        g_idx = get("g_idx") if reader.has(prefix + "g_idx") else None
        m = gptq_matrix(qweight, get("qzeros"), scales, g_idx, group, gptq_v1, where)
    elif scheme in ("modelopt-nvfp4", "ct-nvfp4"):
        name = "weight" if scheme == "modelopt-nvfp4" else "weight_packed"
        where = _where(reader, prefix, name)
        packed = get(name)
        rows_k = (packed.shape[0], packed.shape[-1] * 2)
        fmt = ExpertFormat("nvfp4")
        if scheme == "modelopt-nvfp4":
            m = modelopt_nvfp4_matrix(packed, get("weight_scale"), get("weight_scale_2"), *rows_k, where)
        else:
            m = ct_nvfp4_matrix(packed, get("weight_scale"), get("weight_global_scale"), *rows_k, where)
    else:
        raise QuantCheckpointError(f"{reader.model_dir}: scheme {scheme!r} has no per-module tensors")
    if shape is not None and tuple(rows_k) != tuple(shape):
        raise QuantCheckpointError(f"{where}* holds a [{rows_k[0]}, {rows_k[1]}] matrix but config.json implies "
                                   f"{list(shape)}; the weights and config.json belong to different models")
    return m, fmt, (int(rows_k[0]), int(rows_k[1]))


def _int4_format(group: int, where: str) -> ExpertFormat:
    try:
        return ExpertFormat("int4", group)
    except ValueError as exc:
        raise QuantCheckpointError(f"{where}*: {exc}") from None


class QuantCheckpointExpertSource:
    """The experts of a quantized checkpoint, written into a layer of expert rows in ``fmt``."""

    def __init__(self, reader: CheckpointReader, cfg: MoeConfig, fmt: ExpertFormat | str,
                 quant: CheckpointQuant | None = None, dtype: torch.dtype = torch.bfloat16):
        fmt = ExpertFormat.parse(fmt) if isinstance(fmt, str) else fmt
        self.reader, self.cfg, self.fmt = reader, cfg, fmt
        self.quant = quant if quant is not None else read_checkpoint_quant(reader.model_dir)
        config = Path(reader.model_dir) / "config.json"
        if self.quant is None:
            raise QuantCheckpointError(f"{config} has no quantization_config: the experts are not quantized; "
                                       f"read them with CheckpointExpertSource (or quantize them at load)")
        if self.quant.fmt != fmt:
            raise QuantCheckpointError(
                f"{config}: the checkpoint stores its experts as {self.quant.fmt.label} "
                f"({SCHEME_LABEL.get(self.quant.scheme, self.quant.scheme)}), not {fmt.label}; serve it "
                f"as {self.quant.fmt.label}")
        # layout: the ExpertSource protocol's (the compute dtype the rows dequantize to, the format);
        # quant_layout: the byte regions of one expert row
        self.layout = ExpertLayout(cfg.hidden_size, cfg.expert_intermediate_size, dtype, fmt, expert_act_of(cfg))
        self.quant_layout = QuantLayout(cfg.hidden_size, cfg.expert_intermediate_size, fmt)
        self.num_layers, self.num_experts = cfg.num_layers, cfg.num_experts
        self._staging: torch.Tensor | None = None

    def layer_matrices(self, layer: int) -> list[tuple[QuantMatrix, QuantMatrix, QuantMatrix]]:
        """(gate, up, down) of every expert of ``layer``."""
        if self.quant.scheme == "mxfp4":
            return self._mxfp4_layer(layer)
        return [self.expert_matrices(layer, e) for e in range(self.num_experts)]

    def expert_matrices(self, layer: int, expert: int) -> tuple[QuantMatrix, QuantMatrix, QuantMatrix]:
        if self.quant.scheme == "mxfp4":
            return self._mxfp4_layer(layer)[expert]
        H, I = self.cfg.hidden_size, self.cfg.expert_intermediate_size
        mats = []
        for name, shape in zip(expert_names(self.cfg, layer, expert), ((I, H), (I, H), (H, I))):
            prefix = name[: -len("weight")]
            m, _, _ = read_quant_matrix(self.reader, prefix, self.quant.scheme, group=self.fmt.group_size or None,
                                        symmetric=self.quant.symmetric, gptq_v1=self.quant.gptq_v1, shape=shape)
            mats.append(m)
        return mats[0], mats[1], mats[2]

    def _mxfp4_layer(self, layer: int) -> list[tuple[QuantMatrix, QuantMatrix, QuantMatrix]]:
        E, H, I = self.num_experts, self.cfg.hidden_size, self.cfg.expert_intermediate_size
        gu, down = fused_expert_names(layer)
        for name in (gu + "_blocks", gu + "_scales", down + "_blocks", down + "_scales"):
            if not self.reader.has(name):
                plain = self.reader.has(expert_names(self.cfg, layer, 0)[0]) or self.reader.has(gu)
                raise QuantCheckpointError(
                    f"{self.reader.model_dir}: {name} is missing"
                    + (": the layer's experts are stored unquantized, but the quantization_config says mxfp4; "
                       "a checkpoint mixing formats is not supported" if plain else
                       "; mxfp4 experts are read in gpt-oss's layout (experts.gate_up_proj_blocks / _scales, "
                       "experts.down_proj_blocks / _scales)"))
        for bias in (gu + "_bias", down + "_bias"):
            if self.reader.has(bias) and not self.layout.bias_numel:
                raise QuantCheckpointError(f"{self.reader.model_dir}: {bias}: expert biases (gpt-oss) are not "
                                           f"supported by this architecture; the experts would be computed wrong")
        gub = self.reader.get(gu + "_blocks", (E, 2 * I, H // 32, 16))
        gus = self.reader.get(gu + "_scales", (E, 2 * I, H // 32))
        db = self.reader.get(down + "_blocks", (E, H, I // 32, 16))
        ds = self.reader.get(down + "_scales", (E, H, I // 32))
        where = _where(self.reader, f"model.layers.{layer}.mlp.experts.", "gate_up_proj_blocks")
        out = []
        for e in range(E):
            gate, up = mxfp4_gate_up(gub[e], gus[e], I, H, f"{where}[{e}].")
            d = mxfp4_matrix(db[e], ds[e], H, I, f"{where}[{e}].", ("down_proj_blocks", "down_proj_scales"))
            out.append((gate, up, d))
        return out

    def fill_layer(self, layer: int, out: torch.Tensor) -> None:
        """Write layer ``layer``'s experts into ``out: [E, >= expert_nbytes] uint8`` (any device)."""
        nbytes = self.layout.expert_nbytes
        if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] != self.num_experts or out.shape[1] < nbytes:
            raise ValueError(f"out must be [{self.num_experts}, >= {nbytes}] uint8 ({self.fmt.label} experts); "
                             f"got {out.dtype} {tuple(out.shape)}")
        host = out if out.device.type == "cpu" else self._staging_layer(out)
        for e, (gate, up, down) in enumerate(self.layer_matrices(layer)):
            row = host[e, :nbytes]
            row.zero_()                           # alignment gaps between regions are zero
            pack_expert(gate, up, down, self.quant_layout, out=row)
        if self.layout.bias_numel:                # gpt-oss: the biases at the rows' ends
            fill_gpt_oss_biases(self.reader, layer, self.num_experts, self.layout, host)
        if host is not out:
            out.copy_(host, non_blocking=False)

    def _staging_layer(self, out: torch.Tensor) -> torch.Tensor:
        if self._staging is None or self._staging.shape != out.shape:
            self._staging = torch.empty(tuple(out.shape), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging


def dequantize_dense(reader: CheckpointReader, name: str, quant: CheckpointQuant | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tensor ``name`` of a (possibly quantized) checkpoint, dequantized exactly to float32 (then ``dtype``).

    A weight stored quantized (``...q_proj.weight`` as ``weight`` + ``weight_scale_inv``, or
    ``weight_packed`` ..., ``qweight`` ...) is decoded as its format defines; a plain tensor is returned
    as stored (cast to ``dtype`` when floating). ``quant`` (read from config.json when needed): GPTQ's
    zero-point convention."""
    prefix = name[: -len("weight")] if name.endswith("weight") else None
    scheme = stored_scheme(reader, prefix) if prefix is not None else None
    if scheme is None:
        t = reader.get(name)
        if t.dtype in INT_DTYPES and reader.has(name) and name.endswith("weight"):
            shard = reader.shard_of[name].name
            raise QuantCheckpointError(
                f"{shard}: {name} is {str(t.dtype).replace('torch.', '')} with no scales beside it "
                f"(no {prefix}weight_scale_inv / weight_scale_2); reading it as plain weights would be wrong")
        return t.to(dtype) if t.is_floating_point() else t
    gptq_v1 = True
    if scheme == "gptq":
        quant = quant if quant is not None else read_checkpoint_quant(reader.model_dir)
        gptq_v1 = quant.gptq_v1 if quant is not None and quant.scheme == "gptq" else True
    m, fmt, (rows, k) = read_quant_matrix(reader, prefix, scheme, gptq_v1=gptq_v1)
    return dequantize_matrix(m, fmt, rows, k).to(dtype)


class DequantizingReader:
    """A `CheckpointReader` view whose ``get`` returns quantized weights dequantized (float32)."""

    def __init__(self, reader: CheckpointReader, quant: CheckpointQuant | None = None):
        self.reader, self.model_dir, self.shard_of = reader, reader.model_dir, reader.shard_of
        self.quant = quant if quant is not None else read_checkpoint_quant(reader.model_dir)

    def has(self, name: str) -> bool:
        if self.reader.has(name):
            return True
        return name.endswith("weight") and stored_scheme(self.reader, name[: -len("weight")]) is not None

    def names(self) -> list[str]:
        return self.reader.names()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        tensor = dequantize_dense(self.reader, name, self.quant)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} has shape {tuple(tensor.shape)} but "
                                  f"config.json implies {tuple(shape)}; the weights and config.json belong to "
                                  f"different models")
        return tensor

    def get_into(self, name: str, out: torch.Tensor) -> None:
        out.copy_(self.get(name, tuple(out.shape)))

    def close(self) -> None:
        self.reader.close()
