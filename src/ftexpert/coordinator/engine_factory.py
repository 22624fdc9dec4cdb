"""Build the in-process engine for `ft serve`: load the model once, make engines from it on demand.

The model (dense weights + expert backend) is loaded once; `engine_factory()` makes a fresh Engine
around it (used at start and by RestartWorker), so a restart does not reload weights.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from ftexpert.proto.bandwidth_profile import ExpertFormat
from ftexpert.coordinator.text_codec import TextCodec

log = logging.getLogger("ft.coordinator.engine_factory")


@dataclass
class ServedEngine:
    engine_factory: Callable[[], Any]
    codec: TextCodec
    model_name: str
    context_length: int
    expert_format: ExpertFormat | None
    gpu_name: str                      # "" on the CPU
    description: str


def served_name(model_dir: str | None, preset: str | None, served_model_name: str | None) -> str:
    """The model name clients use: --served-model-name, else the directory's name, the preset, or 'tiny'."""
    return served_model_name or (os.path.basename(os.path.normpath(model_dir)) if model_dir else (preset or "tiny"))


def expert_format_of(cfg: Any, fmt: str = "bf16") -> ExpertFormat | None:
    """The experts' dtype, shape and format (an expert format label: the served one, ModelSource.expert_format) for
    the policy's bandwidth profiles (None when the policy does not know it)."""
    try:
        return ExpertFormat(str(cfg.dtype).replace("torch.", ""), cfg.hidden_size, cfg.expert_intermediate_size, fmt)
    except (ValueError, AttributeError) as exc:
        log.info("expert format unknown to the policy (%s); bandwidth profiles will not apply", exc)
        return None


def load_served_engine(model_dir: str | None, preset: str | None, device: str, *, moe_strategy: str = "resident",
                       moe_cache_size: int | None = None, max_running_requests: int = 8,
                       max_context_tokens: int | None = None, served_model_name: str | None = None,
                       hybrid: Any = None, slot_audit_every: int = 0,
                       prefill_chunk_tokens: int | None = None, overlap_decode: bool | None = None,
                       loaded: Any = None, expert_format: str = "auto") -> ServedEngine:
    """The engine `ft serve --workers inline` serves (`hybrid`: HybridOptions for cpu/hybrid, None: defaults;
    `slot_audit_every`: FREETOKEN_MOE_SLOT_AUDIT; `prefill_chunk_tokens`: None = the engine's default for the
    backend; `overlap_decode`: EngineConfig's, None = on CUDA; `loaded`: the model, already loaded over the host
    resources of serve_cli's ExpertResources, for offload/cpu/hybrid)."""
    import torch

    from ftexpert.gpu_worker.api import Engine, EngineConfig, load_model

    if loaded is None:
        loaded = load_model(model_dir, preset, device=device, moe_strategy=moe_strategy, moe_cache_size=moe_cache_size,
                            hybrid=hybrid, expert_format=expert_format)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise FileNotFoundError(f"{model_dir or preset} has no tokenizer.json; the HTTP API needs one to turn "
                                f"text into tokens (put the model's tokenizer.json beside its weights)")
    codec = TextCodec.from_text_tokenizer(tokenizer, loaded.eos_token_ids)
    config = EngineConfig(max_running_requests=max_running_requests, max_context_tokens=max_context_tokens,
                          slot_audit_every=slot_audit_every, prefill_chunk_tokens=prefill_chunk_tokens,
                          overlap_decode=overlap_decode)

    def engine_factory() -> Any:
        return Engine(loaded.model, config, loaded.eos_token_ids)

    probe = engine_factory()          # fails here, at start, if the configuration is impossible
    first = [probe]

    def factory_reusing_probe() -> Any:
        return first.pop() if first else engine_factory()

    cfg = loaded.cfg
    name = served_name(model_dir, preset, served_model_name)
    expert_format = expert_format_of(cfg, loaded.source.expert_format.label)
    gpu_name = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else ""
    return ServedEngine(factory_reusing_probe, codec, name, probe.max_context_tokens, expert_format, gpu_name,
                        loaded.source.description)
