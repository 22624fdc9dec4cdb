"""Loading: a checkpoint directory, a preset, or the tiny default -> a ready `MoeModel`.

Two steps, so that processes that need only part of a model can stop after the first:
- ``open_model_source(model_dir, preset)`` -> `ModelSource`: config, dtype, tokenizer, EOS ids, the
  `ExpertSource` (the shared-memory expert store is filled from it) and a dense loader.
- ``model_facts(source)`` -> `ModelFacts` (proto/model_facts.py): what the coordinator needs to know of it
  (vocabulary, tokenizer directory, the experts' shape and format), torch-free;
- ``load_model(...)`` -> `LoadedModel`: dense weights on the device, the expert backend chosen by
  ``moe_strategy`` (expert_backends.py), and the `MoeModel`.

Which source: ``model_dir`` only: that checkpoint. ``preset`` only: random weights of that shape made
in memory on the device (``tiny``: the cached tiny checkpoint). Both: the preset is written to
``model_dir`` first if it holds no config.json. Neither: the tiny default.

The experts' format (``expert_format``, ``--expert-format``; quant_config.resolve_served_format): ``auto`` serves
them as the checkpoint stores them (its config.json's quantization_config; float: bf16). A float checkpoint or a
preset takes any format, quantized while loading (format_sources.QuantizingExpertSource); a quantized checkpoint
(quant_checkpoint.QuantCheckpointExpertSource) is served in its format or dequantized to bf16.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ftexpert.gpu_worker.checkpoint.reader import CheckpointReader
from ftexpert.gpu_worker.checkpoint.writer import write_checkpoint
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_weights import DenseWeights, load_dense_weights
from ftexpert.gpu_worker.assembly.device import resolve_device, resolve_dtype
from ftexpert.gpu_worker.assembly.backends import make_expert_backend
from ftexpert.gpu_worker.checkpoint.expert_sources import CheckpointExpertSource, ExpertSource, RandomExpertSource
from ftexpert.gpu_worker.checkpoint.format_sources import DequantizingExpertSource, QuantizingExpertSource
from ftexpert.gpu_worker.backends.offload.host_store import layout_hash
from ftexpert.gpu_worker.backends.offload.prefetch import attach_prefetch
from ftexpert.gpu_worker.models.architectures import make_model
from ftexpert.gpu_worker.models.model import MoeModel
from ftexpert.gpu_worker.checkpoint.presets import DEFAULT_MODEL_DIR, TINY, preset_config, random_model_parts
from ftexpert.gpu_worker.checkpoint.quant_checkpoint import DequantizingReader, QuantCheckpointExpertSource
from ftexpert.gpu_worker.checkpoint.quant_config import resolve_served_format

from ftexpert.gpu_worker.checkpoint.tiny import ensure_tiny_checkpoint, write_tiny_checkpoint
from ftexpert.gpu_worker.checkpoint.tokenizer import TextTokenizer, generation_eos_ids
from ftexpert.proto.expert_format import ExpertFormat, FormatError
from ftexpert.proto.model_facts import ModelFacts


MAX_POSITIONS = 32768                # rotary tables are built for at most this many positions


@dataclass
class ModelSource:
    cfg: MoeConfig
    dtype: torch.dtype                              # dense and expert weights' dtype
    experts: ExpertSource
    tokenizer: TextTokenizer | None
    eos_token_ids: tuple[int, ...]
    description: str                                # for logs: where the weights come from
    load_dense: Callable[[torch.device], DenseWeights]
    model_dir: Path | None = None

    @property
    def expert_format(self) -> ExpertFormat:
        """The format the experts are served in (the store's, the slots', the CPU pool's)."""
        return self.experts.layout.fmt


@dataclass
class LoadedModel:
    source: ModelSource
    model: MoeModel
    device: torch.device
    load_time_s: float

    @property
    def cfg(self) -> MoeConfig:
        return self.source.cfg

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.source.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.source.eos_token_ids


def model_facts(source: ModelSource) -> ModelFacts:
    """The facts of `source` the coordinator serves by: vocabulary, tokenizer, EOS ids, the experts' shape, dtype,
    format and store config hash. The EOS ids are the source's and its tokenizer's (what TextCodec takes)."""
    experts, lay = source.experts, source.experts.layout
    tokenizer = source.tokenizer
    eos = set(source.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer is not None else ())
    directory = tokenizer.directory if tokenizer is not None else None
    return ModelFacts(description=source.description, vocab_size=source.cfg.vocab_size,
                      hidden_size=source.cfg.hidden_size, top_k=source.cfg.top_k, num_layers=experts.num_layers,
                      num_experts=experts.num_experts, expert_intermediate_size=lay.intermediate_size,
                      dtype=str(lay.dtype).removeprefix("torch."), expert_format=lay.fmt.label,
                      expert_act=lay.act.label, config_hash=layout_hash(experts), eos_token_ids=tuple(sorted(eos)),
                      tokenizer_dir=str(directory) if directory is not None else "")


def serve_experts_as(source: ExpertSource, fmt: ExpertFormat, dtype: torch.dtype) -> ExpertSource:
    """``source`` in the format ``fmt``: itself, quantized while loading, or dequantized to ``dtype``."""
    if source.layout.fmt == fmt:
        return source
    if fmt.quantized:
        return QuantizingExpertSource(source, fmt)
    return DequantizingExpertSource(source, dtype)


def _format_note(fmt: ExpertFormat) -> str:
    return f", {fmt.label} experts" if fmt.quantized else ""


def _quant_checkpoint_experts(reader: CheckpointReader, cfg: MoeConfig, fmt: ExpertFormat,
                              dtype: torch.dtype, model_dir: Path) -> ExpertSource:
    """The experts of a checkpoint stored in ``fmt`` (gpu_worker/checkpoint/quant_checkpoint.py reads its layouts)."""
    return QuantCheckpointExpertSource(reader, cfg, fmt, dtype=dtype)


def _checkpoint_source(model_dir: Path, dtype: str | torch.dtype | None,
                       expert_format: str | ExpertFormat | None = None) -> ModelSource:
    cfg = MoeConfig.from_dir(model_dir)
    reader = CheckpointReader(model_dir)
    wdtype = resolve_dtype(dtype, cfg.dtype)
    stored = ExpertFormat.parse(cfg.expert_format)
    served = resolve_served_format(stored, expert_format)
    experts = (_quant_checkpoint_experts(reader, cfg, stored, wdtype, model_dir) if stored.quantized
               else CheckpointExpertSource(reader, cfg, wdtype))
    # a quantized checkpoint's dense weights (attention, router, shared experts) are dequantized at load
    dense_reader = DequantizingReader(reader) if cfg.quantization else reader
    tokenizer = TextTokenizer.from_dir(model_dir)
    eos = set(cfg.eos_token_ids) | set(generation_eos_ids(model_dir))
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    return ModelSource(
        cfg=cfg, dtype=wdtype, experts=serve_experts_as(experts, served, wdtype), tokenizer=tokenizer,
        eos_token_ids=tuple(sorted(eos)), description=f"checkpoint {model_dir}{_format_note(served)}",
        load_dense=lambda device: load_dense_weights(dense_reader, cfg, device, wdtype), model_dir=model_dir)


def _random_source(preset: str, dtype: str | torch.dtype | None, seed: int,
                   device: torch.device, expert_format: str | ExpertFormat | None = None) -> ModelSource:
    cfg = preset_config(preset)
    wdtype = resolve_dtype(dtype, cfg.dtype)
    # the random weights are float; auto serves them in the preset's format (gpt-oss: mxfp4, quantized at load)
    auto = expert_format is None or (isinstance(expert_format, str) and expert_format.strip().lower() in ("", "auto"))
    served = (ExpertFormat.parse(cfg.expert_format) if auto
              else resolve_served_format(ExpertFormat("bf16"), expert_format))
    experts = RandomExpertSource(cfg, wdtype, seed, std=float(cfg.extra.get("initializer_range", 0.02)))
    experts = serve_experts_as(experts, served, wdtype)
    tokenizer = TextTokenizer.from_dir(ensure_tiny_checkpoint())   # encodes text; random ids mostly decode to ""

    def load_dense(dev: torch.device) -> DenseWeights:
        return random_model_parts(cfg, dev, wdtype, seed)[1]

    return ModelSource(cfg=cfg, dtype=wdtype, experts=experts, tokenizer=tokenizer,
                       eos_token_ids=cfg.eos_token_ids,
                       description=(f"preset {preset} (random weights, seed {seed}, made on {device.type}"
                                    f"{_format_note(served)})"),
                       load_dense=load_dense)


def _write_preset(preset: str, model_dir: Path, seed: int) -> None:
    if preset == TINY:
        write_tiny_checkpoint(model_dir)
        return
    cfg = preset_config(preset)
    _, dense, experts = random_model_parts(cfg, "cpu", getattr(torch, cfg.dtype), seed)
    tok_dir = ensure_tiny_checkpoint()          # the tiny tokenizer, so that --prompt text works
    extra = {"tokenizer.json": (tok_dir / "tokenizer.json").read_text()}  # not its EOS ids / template
    fmt = "mxfp4" if cfg.expert_format == "mxfp4" else "hub"              # gpt-oss: as the hub stores it
    write_checkpoint(model_dir, cfg.replace(expert_format="bf16"), dense, experts, expert_format=fmt,
                     shards="per_layer", extra_files=extra)


def open_model_source(model_dir: str | Path | None = None, preset: str | None = None,
                      dtype: str | torch.dtype | None = "auto", seed: int = 0,
                      device: str | torch.device = "auto",
                      expert_format: str | ExpertFormat | None = "auto") -> ModelSource:
    """Resolve where the weights come from and the experts' format (see the module docstring); reads no expert
    yet. ``expert_format``: an ExpertFormat label (bf16, fp8, int4, int4-g32, int4-g64, mxfp4, nvfp4) or auto."""
    device = resolve_device(device)
    if preset is not None and preset != TINY:
        preset_config(preset)                                        # fail early on a typo
    if model_dir is None:
        if preset is None or preset == TINY:
            return _checkpoint_source(ensure_tiny_checkpoint(), dtype, expert_format)
        return _random_source(preset, dtype, seed, device, expert_format)
    model_dir = Path(model_dir).expanduser()
    if preset is not None and not (model_dir / "config.json").is_file():
        _write_preset(preset, model_dir, seed)
    return _checkpoint_source(model_dir, dtype, expert_format)


def load_model(model_dir: str | Path | None = None, preset: str | None = None, *,
               device: str | torch.device = "auto", dtype: str | torch.dtype | None = "auto",
               moe_strategy: str = "resident", moe_cache_size: int | float | str | None = None, seed: int = 0,
               expert_compute: str = "auto", hybrid=None,
               fused_kernels: bool | None = None, expert_format: str | ExpertFormat | None = "auto",
               prefetch=None) -> LoadedModel:
    """Load dense weights and build the expert backend on ``device``; see module docstring.

    prefetch: a ``gpu_worker.backends.offload.prefetch.PrefetchSettings`` for the lookahead expert prefetch (None: off).
    hybrid: ``gpu_worker.backends.hybrid.HybridOptions`` for the ``cpu`` and ``hybrid`` strategies.
    fused_kernels: `MoeModel`'s fused forward (kernels/moe_decode); None: on CUDA only."""
    t0 = time.perf_counter()
    device = resolve_device(device)
    source = open_model_source(model_dir, preset, dtype=dtype, seed=seed, device=device, expert_format=expert_format)
    experts = make_expert_backend(moe_strategy, source.experts, device, cache_size=moe_cache_size,
                                  mode=expert_compute, hybrid=hybrid, top_k=source.cfg.top_k)
    model = assemble_model(source, experts, device, prefetch, fused_kernels=fused_kernels)
    return LoadedModel(source=source, model=model, device=device, load_time_s=time.perf_counter() - t0)


def assemble_model(source: ModelSource, experts, device: torch.device, prefetch=None, *,
                   fused_kernels: bool | None = None, routing=None, dense_linear: str | None = None,
                   predictor=None) -> MoeModel:
    """The architecture's forward over `experts` (an ExpertBackend, closed here if this fails): the dense weights
    on `device`, rotary tables for up to MAX_POSITIONS, the synthetic routing (`routing`: a SyntheticRouting or
    None), the dense projections (`dense_linear`: gemv / torch; None: the model's default), the lookahead prefetch
    (`prefetch`: PrefetchSettings or None; `predictor`: its predictor, None: the model's). Every model the GPU
    worker builds is assembled here."""
    try:
        cfg = source.cfg
        model = make_model(cfg, source.load_dense(device), experts,
                           max_positions=min(MAX_POSITIONS, cfg.context_length), fused_kernels=fused_kernels)
        model.routing_override = routing
        if dense_linear is not None:
            model.dense_linear = dense_linear
        attach_prefetch(model, prefetch, predictor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException:
        experts.close()
        raise
    return model
