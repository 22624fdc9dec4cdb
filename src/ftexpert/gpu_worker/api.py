"""The GPU worker's public interface for the other processes' code (the coordinator's `ft serve`,
`ft generate` and its resource owner); everything else in gpu_worker is internal to it.

- the checkpoint's expert layout and loader: ``open_model_source`` (config, tokenizer, `ExpertSource`),
  ``model_facts`` (what the coordinator serves by, proto/model_facts.py), ``fill_expert_store`` (write the
  experts into a shared-memory store its owner created);
- building an engine: ``build_engine(spec)`` (proto/engine_spec.py), over the store and CPU channels an
  ``Attachment`` names where someone else created them (or a store and CPU pool already open in this process:
  a benchmark's rows); ``BuiltEngine.fresh_engine(spec)`` and ``build_engine(spec, reuse=built)`` for more engines
  over the same model; ``Engine`` (the type) / ``SamplingParams``. Nothing else constructs an `Engine`;
- for benchmarks and tools that take a model apart without an engine: ``load_model`` (dense weights, the expert
  backend, the `MoeModel`) and ``attach_cpu_pool``;
- ``HybridOptions`` (the cpu / hybrid backends' settings) and ``channel_hidden_dtype``.

Importing this module imports torch: `ft serve` in process mode does not import it (gpu_worker/store_main.py
opens the model for it in a child).
"""
from __future__ import annotations

from typing import Callable

import torch

from ftexpert.gpu_worker.engine import Engine, EngineConfig, SamplingParams
from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions
from ftexpert.gpu_worker.assembly.build import Attachment, BuiltEngine, build_engine, pin_engine_process
from ftexpert.gpu_worker.assembly.attached_backends import needs_host_store
from ftexpert.gpu_worker.assembly.device import resolve_device
from ftexpert.gpu_worker.assembly.loader import (DEFAULT_MODEL_DIR, LoadedModel, ModelSource, load_model,
                                                 model_facts, open_model_source)
from ftexpert.gpu_worker.backends.offload.prefetch import PREFETCH_KNOBS, PrefetchSettings
from ftexpert.gpu_worker.backends.offload.host_store import HostExperts, fill_expert_store
from ftexpert.gpu_worker.worker_loop import gpu_busy_loop
from ftexpert.proto.shm_layout import channel_hidden_dtype
from ftexpert.proto.expert_store import ExpertStore

__all__ = ["Attachment", "BuiltEngine", "build_engine", "pin_engine_process", "DEFAULT_MODEL_DIR", "PREFETCH_KNOBS", "PrefetchSettings", "Engine", "EngineConfig", "HostExperts", "gpu_busy_loop", "HybridOptions", "attach_cpu_pool", "LoadedModel", "ModelSource", "SamplingParams",
           "channel_hidden_dtype", "fill_expert_store", "load_model", "model_facts",
           "needs_host_store", "open_model_source", "resolve_device"]


def attach_cpu_pool(store: ExpertStore, channel_names: list[str], options: HybridOptions | None = None, *,
                    worker_info: Callable[[], list[dict]] | None = None, pin_driving_process: bool = True):
    """A CpuPool on the owner's channels (a benchmark that builds HybridExperts itself); this process's torch
    threads set to options.engine_thread_count() and, where the options say so, it pins itself to the reserved
    CPUs (the workers' flags were resolved before the pin)."""
    from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool   # lazy: ZMQ loads only for cpu / hybrid

    options = options or HybridOptions()
    pool = CpuPool.attach(store, list(channel_names), deadline_s=options.cpu_deadline_s,
                          readmit_poll_s=options.readmit_poll_s, ready_timeout_s=options.ready_timeout_s,
                          worker_info=worker_info)
    torch.set_num_threads(options.engine_thread_count())
    if pin_driving_process:
        options.pin_driving_process("the engine's process")
    return pool
