"""The GPU worker's public interface for the other processes' code (the coordinator's `ft serve`,
`ft generate` and its resource owner); everything else in gpu_worker is internal to it.

- the checkpoint's expert layout and loader: ``open_model_source`` (config, tokenizer, `ExpertSource`),
  ``model_facts`` (what the coordinator serves by, proto/model_facts.py), ``fill_expert_store`` (write the
  experts into a shared-memory store its owner created);
- building an engine: ``build_engine(spec)`` (proto/engine_spec.py), over the store and CPU channels an
  ``Attachment`` names where someone else created them; ``Engine`` / ``SamplingParams``;
- for benchmarks that take a model apart: ``load_attached_model`` and ``load_model`` (dense weights, the expert
  backend, the `MoeModel`, no engine);
- ``HybridOptions`` (the cpu / hybrid backends' settings) and ``channel_hidden_dtype``.

Importing this module imports torch: `ft serve` in process mode does not import it (gpu_worker/store_main.py
opens the model for it in a child).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ftexpert.gpu_worker.engine import Engine, EngineConfig, SamplingParams
from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions
from ftexpert.gpu_worker.assembly.build import Attachment, BuiltEngine, build_engine, pin_engine_process
from ftexpert.gpu_worker.assembly.attached_backends import make_attached_expert_backend, needs_host_store
from ftexpert.gpu_worker.assembly.device import resolve_device
from ftexpert.gpu_worker.assembly.loader import (DEFAULT_MODEL_DIR, LoadedModel, ModelSource, assemble_model, load_model,
                                                 model_facts, open_model_source)
from ftexpert.gpu_worker.backends.offload.prefetch import PREFETCH_KNOBS, PrefetchSettings
from ftexpert.gpu_worker.backends.offload.host_store import HostExperts, fill_expert_store
from ftexpert.gpu_worker.worker_loop import gpu_busy_loop
from ftexpert.proto.shm_layout import channel_hidden_dtype
from ftexpert.proto.expert_store import ExpertStore

__all__ = ["Attachment", "BuiltEngine", "build_engine", "pin_engine_process", "DEFAULT_MODEL_DIR", "PREFETCH_KNOBS", "PrefetchSettings", "Engine", "EngineConfig", "HostExperts", "gpu_busy_loop", "HybridOptions", "attach_cpu_pool", "LoadedModel", "ModelSource", "SamplingParams",
           "channel_hidden_dtype", "fill_expert_store", "load_attached_model", "load_model", "model_facts",
           "needs_host_store", "open_model_source", "resolve_device"]


def load_attached_model(source: ModelSource, device: torch.device, *, moe_strategy: str, store_name: str = "",
                        cpu_channels: tuple[str, ...] | list[str] = (), moe_cache_size: int | float | str | None = None,
                        hybrid: HybridOptions | None = None,
                        pin_driving_process: bool = False,
                        worker_info: Callable[[], list[dict]] | None = None,
                        freq_weight: int | None = None, freq_half_life: int | None = None,
                        prefetch: PrefetchSettings | None = None) -> LoadedModel:
    """Dense weights on `device` and the expert backend over the store `store_name` and the CPU workers'
    channels `cpu_channels` (cpu / hybrid), created and supervised elsewhere (coordinator/expert_resources.py).
    pin_driving_process: cpu / hybrid: once loaded, pin this process to the reserved CPUs where `hybrid` says
    so (HybridOptions.pin_driving_process). worker_info: the owner's supervisor view (CpuPool.worker_info).
    prefetch: the lookahead expert prefetch's settings (None: off; docs/PREFETCH.md)."""
    t0 = time.perf_counter()
    experts = make_attached_expert_backend(moe_strategy, source.experts, device, store_name=store_name,
                                           cpu_channels=cpu_channels, cache_size=moe_cache_size, hybrid=hybrid,
                                           worker_info=worker_info, freq_weight=freq_weight,
                                           freq_half_life=freq_half_life)
    model = assemble_model(source, experts, device, prefetch)
    if pin_driving_process and moe_strategy in ("cpu", "hybrid"):
        (hybrid or HybridOptions()).pin_driving_process("the engine's process")
    return LoadedModel(source=source, model=model, device=device, load_time_s=time.perf_counter() - t0)


def attach_cpu_pool(store: ExpertStore, channel_names: list[str], options: HybridOptions | None = None, *,
                    worker_info: Callable[[], list[dict]] | None = None, pin_driving_process: bool = True):
    """A CpuPool on the owner's channels (a benchmark that builds HybridExperts itself); this process's torch
    threads set to options.engine_thread_count() and, where the options say so, it pins itself to the reserved
    CPUs (the workers' flags were resolved before the pin)."""
    from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool

    options = options or HybridOptions()
    pool = CpuPool.attach(store, list(channel_names), deadline_s=options.cpu_deadline_s,
                          readmit_poll_s=options.readmit_poll_s, ready_timeout_s=options.ready_timeout_s,
                          worker_info=worker_info)
    torch.set_num_threads(options.engine_thread_count())
    if pin_driving_process:
        options.pin_driving_process("the engine's process")
    return pool
