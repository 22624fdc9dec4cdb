"""The tests' engines, built as every engine is: `build_engine(spec)` (gpu_worker/assembly/build.py).

    built = build()                                       # the tiny checkpoint, resident, on the CPU
    built = build(model_dir, dtype="float32", moe_strategy="offload", moe_cache_size="10")
    engine = engine_of(built, max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=4)

`spec` fills in what the tests were written against: the CPU, and the Engine's own default batch of 4 requests
(EngineConfig's; ft serve's is 8). A module's model is built once (a fixture) and each test takes an engine of its
own settings over it (`engine_of`: BuiltEngine.fresh_engine); `engine_of(built, experts=backend)` runs one over a
backend the test made or wrapped (a lockstep comparison, a backend that fails on purpose). Build a fixture with
the context its tests use (max_context_tokens): the first engine's KV cache is allocated with it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ftexpert.gpu_worker.api import BuiltEngine, Engine, build_engine
from ftexpert.proto.engine_spec import EngineSpec

TEST_DEFAULTS = {"device": "cpu", "max_running_requests": 4}


def spec(model_dir: str | Path | None = None, **fields: Any) -> EngineSpec:
    """An EngineSpec of `model_dir` (None: the tiny checkpoint, or `preset=`) with the tests' defaults."""
    if model_dir is not None:
        fields["model"] = str(model_dir)
    for name in ("moe_cache_size",):                      # the tests' numbers, as the flag's text
        if fields.get(name) is not None:
            fields[name] = str(fields[name])
    return EngineSpec(**{**TEST_DEFAULTS, **fields})


def build(model_dir: str | Path | None = None, *, attachment=None, hybrid=None, predictor=None, reuse=None,
          **fields: Any) -> BuiltEngine:
    """build_engine(spec(model_dir, **fields)); never pins the test process (cpu / hybrid)."""
    return build_engine(spec(model_dir, **fields), attachment=attachment, hybrid=hybrid, predictor=predictor,
                        reuse=reuse, pin_driving_process=False)


def engine_of(built: BuiltEngine, *, experts=None, **fields: Any) -> Engine:
    """A new engine over `built`'s model with these engine settings (the built spec's otherwise); `experts`: over
    that backend instead (the caller's)."""
    return built.fresh_engine(dataclasses.replace(built.spec, **fields), experts=experts)


def build_with_resources(strategy: str, *, cache_size=None, hybrid=None, num_workers: int = 2, worker_args=(),
                         backoff_s: float = 0.1, ready_timeout_s: float = 120.0, model_dir=None,
                         log_level: str = "WARNING", **fields: Any) -> BuiltEngine:
    """The engine for `strategy` (offload, cpu, hybrid) over host resources from their one owner
    (coordinator/expert_resources.py: the store, the CPU channels, the supervised workers), attached as the GPU
    worker attaches them (an `Attachment`); `model_dir`: that checkpoint instead of the tiny one. `built.resources`
    is the owner; closing the engine also closes it (the workers stopped, the channels and the store unlinked)."""
    import os
    import uuid

    from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources
    from ftexpert.gpu_worker.api import Attachment, open_model_source, resolve_device

    full = spec(model_dir, moe_strategy=strategy, moe_cache_size=cache_size, **fields)
    dev = resolve_device(full.device)
    source = open_model_source(full.model, full.preset, dtype=full.dtype, device=dev, expert_format=full.expert_format)
    cpu = CpuWorkerSettings(num_workers=num_workers, worker_args=tuple(worker_args), backoff_initial_s=backoff_s,
                            ready_timeout_s=ready_timeout_s, log_level=log_level)
    resources = ExpertResources.create(source, strategy, store_name=f"ft-test-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                       cpu=cpu, staging_device=dev if dev.type == "cuda" else None)
    try:
        resources.start_cpu_workers()
        built = build_engine(full, source=source, hybrid=hybrid, pin_driving_process=False,
                             attachment=Attachment(resources.store_name, tuple(resources.channel_names),
                                                   resources.worker_info))
    except BaseException:
        resources.close()
        raise
    backend = built.experts
    close_backend = backend.close

    def close() -> None:
        try:
            close_backend()
        finally:
            resources.close()

    backend.close = close
    built.resources = resources
    return built
