"""`build_engine(spec)`: the one place an engine is assembled.

Every engine is built here from an `EngineSpec` (proto/engine_spec.py): the GPU worker process (from the spec
its coordinator sent in WELCOME), `ft serve --workers inline`, `ft generate`, the benches and the tests. In
order: the PDL setting; the device; the checkpoint (`open_model_source`, unless the caller opened it already
to fill the expert store); the expert backend (over the host resources the coordinator's `ExpertResources`
made, when an `Attachment` names them; else the strategies that need none); the dense weights and the
architecture's forward and the lookahead prefetch (`assemble_model`, loader.py); the `Engine`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ftexpert.gpu_worker.assembly.attached_backends import make_attached_expert_backend
from ftexpert.gpu_worker.assembly.backends import make_expert_backend
from ftexpert.gpu_worker.assembly.device import resolve_device
from ftexpert.gpu_worker.assembly.loader import ModelSource, assemble_model, open_model_source
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions
from ftexpert.gpu_worker.backends.offload.prefetch import settings_from_knobs
from ftexpert.gpu_worker.engine import Engine, EngineConfig
from ftexpert.kernels.pdl import apply_setting
from ftexpert.proto.engine_spec import EngineSpec

@dataclass(frozen=True)
class Attachment:
    """Host resources someone else created and owns (coordinator/expert_resources.py): the shared-memory expert
    store and, for cpu / hybrid, the CPU workers' channels."""
    store_name: str
    cpu_channels: tuple[str, ...] = ()
    worker_info: Callable[[], list[dict]] | None = None     # the owner's supervisor view of the CPU workers


@dataclass
class BuiltEngine:
    engine: Engine
    source: ModelSource
    device: torch.device
    experts: ExpertBackend
    load_time_s: float

    @property
    def model(self) -> Any:
        return self.engine.model

    def fresh_engine(self) -> Engine:
        """Another engine over the same model and settings (a restart that reloads no weights)."""
        return Engine(self.model, self.engine.config, self.source.eos_token_ids)

    def close(self) -> None:
        """Detach the expert backend from the store and the channels (their owner unlinks them)."""
        self.experts.close()


def kv_block_size(spec: EngineSpec) -> dict[str, int]:
    """EngineConfig's kv_block_size where the spec sets one (else the engine's default)."""
    return {} if spec.kv_block_size is None else {"kv_block_size": spec.kv_block_size}


def hybrid_options(spec: EngineSpec, base: HybridOptions | None = None) -> HybridOptions:
    """The cpu / hybrid backends' options: `base` (ft generate's CPU-side flags; default: the defaults) with the
    spec's reserved CPUs and pin setting."""
    return dataclasses.replace(base or HybridOptions(), reserve_cpus=spec.reserve_cpus,
                               pin_gpu_worker=spec.pin_gpu_worker == "on")


def pin_engine_process(spec: EngineSpec, hybrid: HybridOptions | None = None,
                       what: str = "the engine's process") -> tuple[int, ...] | None:
    """cpu / hybrid: pin this process (every thread) to the CPUs the CPU workers keep off, where the spec says so;
    the CPUs pinned to, or None (another strategy, or the pin is off)."""
    if not spec.uses_cpu_pool:
        return None
    return hybrid_options(spec, hybrid).pin_driving_process(what)


def build_engine(spec: EngineSpec, *, attachment: Attachment | None = None, source: ModelSource | None = None,
                 hybrid: HybridOptions | None = None, pin_driving_process: bool = True,
                 process_name: str = "the engine's process") -> BuiltEngine:
    """The engine `spec` describes. `attachment`: the store (and CPU channels) to attach for offload / cpu /
    hybrid (None: offload makes its own store; cpu / hybrid need one). `source`: the checkpoint, already opened
    by the caller (it filled the store from it). `hybrid`: cpu / hybrid options beyond the spec's (ft generate).
    pin_driving_process: cpu / hybrid: pin this process to the reserved CPUs once loaded, as the options say
    (`process_name` names it in the log)."""
    t0 = time.perf_counter()
    apply_setting(spec.pdl, spec.device)
    device = resolve_device(spec.device)
    if source is None:
        source = open_model_source(spec.model, spec.preset, dtype=spec.dtype, seed=spec.seed_weights, device=device,
                                   expert_format=spec.expert_format)
    options = hybrid_options(spec, hybrid) if spec.uses_cpu_pool else None
    if attachment is not None:
        experts = make_attached_expert_backend(spec.moe_strategy, source.experts, device,
                                               store_name=attachment.store_name, cpu_channels=attachment.cpu_channels,
                                               cache_size=spec.moe_cache_size, hybrid=options,
                                               worker_info=attachment.worker_info,
                                               freq_weight=spec.eviction_freq_weight,
                                               freq_half_life=spec.eviction_freq_half_life)
    else:
        experts = make_expert_backend(spec.moe_strategy, source.experts, device, cache_size=spec.moe_cache_size,
                                      hybrid=options, top_k=source.cfg.top_k)
    model = assemble_model(source, experts, device, settings_from_knobs(spec.to_wire()))
    try:
        engine = Engine(model, EngineConfig(max_running_requests=spec.max_running_requests,
                                            max_context_tokens=spec.max_context_tokens,
                                            slot_audit_every=spec.moe_slot_audit,
                                            prefill_chunk_tokens=spec.prefill_chunk_tokens,
                                            overlap_decode=spec.overlap, kv_cache_gib=spec.kv_cache_gib,
                                            prefix_caching=spec.prefix_cache == "on",
                                            **kv_block_size(spec)), source.eos_token_ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)          # the KV cache allocated: the load time covers it
    except BaseException:
        experts.close()
        raise
    if pin_driving_process:
        pin_engine_process(spec, hybrid, process_name)
    return BuiltEngine(engine, source, device, experts, time.perf_counter() - t0)
