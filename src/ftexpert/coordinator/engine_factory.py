"""What `ft serve` serves around an engine: the served name, the codec, the experts' format for the policy (`spec`: the EngineSpec it was built from);
in process mode from the model's facts (proto/model_facts.py: `codec_of`, `expert_format_of`, no torch); for the
inline engine, a factory of engines over one built model (used at start and by RestartWorker), so a restart does
not reload weights.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from ftexpert.proto.bandwidth_profile import ExpertFormat
from ftexpert.proto.model_facts import ModelFacts
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


def expert_format_of(facts: ModelFacts) -> ExpertFormat | None:
    """The experts' dtype, shape and served format (an expert format label) for the policy's bandwidth profiles
    (None when the policy does not know it)."""
    try:
        return ExpertFormat(facts.dtype, facts.hidden_size, facts.expert_intermediate_size, facts.expert_format)
    except ValueError as exc:
        log.info("expert format unknown to the policy (%s); bandwidth profiles will not apply", exc)
        return None


def no_tokenizer(description: str) -> str:
    return (f"{description} has no tokenizer.json; the HTTP API needs one to turn text into tokens (put the model's "
            f"tokenizer.json beside its weights)")


def codec_of(facts: ModelFacts) -> TextCodec:
    """`ft serve`'s codec in process mode: the tokenizer files the model's facts name, read here (no torch)."""
    if not facts.tokenizer_dir:
        raise FileNotFoundError(no_tokenizer(facts.description))
    return TextCodec.from_model_dir(facts.tokenizer_dir, facts.eos_token_ids)


def served_engine(built: Any, spec: Any, served_model_name: str | None = None) -> ServedEngine:
    """What `ft serve --workers inline` serves around a `BuiltEngine` (gpu_worker.api.build_engine): the codec,
    the names, and a factory of engines over the same model (the first call returns the built one), so a restart
    does not reload weights."""
    import torch     # lazy: the inline engine's process has it loaded already; `ft serve` alone does not

    from ftexpert.gpu_worker.api import model_facts   # (likewise)

    source = built.source
    if source.tokenizer is None:
        raise FileNotFoundError(no_tokenizer(source.description))
    codec = TextCodec.from_text_tokenizer(source.tokenizer, source.eos_token_ids)
    first = [built.engine]

    def engine_factory() -> Any:
        return first.pop() if first else built.fresh_engine()

    name = served_name(spec.model, spec.preset, served_model_name)
    gpu_name = torch.cuda.get_device_name(built.device) if built.device.type == "cuda" else ""
    return ServedEngine(engine_factory, codec, name, built.engine.max_context_tokens,
                        expert_format_of(model_facts(source)), gpu_name, source.description)
