"""`build_hybrid_backend`: expert store + CPU worker pool + `HybridExperts`, for make_expert_backend."""
from __future__ import annotations

import atexit
import logging

import torch

from gpu_worker.models.expert_sources import ExpertSource
from gpu_worker.offload import HostExperts, resolve_cache_slots

from .cpu_pool import CpuPool, channel_hidden_dtype
from .hybrid_experts import HybridExperts
from .options import HybridOptions, resolve_fetch_fraction

log = logging.getLogger("ft.hybrid")


def start_cpu_pool(host: HostExperts, options: HybridOptions, top_k: int) -> CpuPool:
    """The CPU workers of `host`'s store, sized for forwards of up to options.cpu_max_tokens tokens.

    Also limits this process's torch CPU threads (options.engine_thread_count()) and pins all its threads
    to the reserved CPUs (options.pin_driving_process: this process drives the GPU), so that they do not
    run on the workers' cores; the pool's close() restores both. The workers are started first, with
    this process's affinity from before as their --allowed-cpus (options.worker_flags())."""
    t_max = options.cpu_max_tokens
    pool = CpuPool.start(host.store, num_workers=options.cpu_workers, t_max=t_max, max_triples=t_max * top_k,
                         hidden_dtype=channel_hidden_dtype(host.layout.dtype), worker_flags=options.worker_flags(),
                         deadline_s=options.cpu_deadline_s, readmit_poll_s=options.readmit_poll_s,
                         restart_backoff_s=options.restart_backoff_s, ready_timeout_s=options.ready_timeout_s,
                         heartbeat_timeout_s=options.heartbeat_timeout_s)
    pool.restore_threads = torch.get_num_threads()
    threads = options.engine_thread_count()
    if threads != pool.restore_threads:
        log.info("torch CPU threads of this process: %d -> %d (the CPU workers compute on the others)",
                 pool.restore_threads, threads)
        torch.set_num_threads(threads)
    try:
        pool.pinned = options.pin_driving_process("the engine's process") is not None
    except BaseException:
        pool.close()
        raise
    return pool


def build_hybrid_backend(strategy: str, source: ExpertSource, device: torch.device | str, *, top_k: int,
                         cache_size: int | float | str | None = None, mode: str = "auto", per_layer: bool = False,
                         options: HybridOptions | None = None) -> HybridExperts:
    """`cpu` or `hybrid`: fill the shared-memory store, start the CPU pool on it, build the backend.

    The backend owns both (close() stops the workers and unlinks the store; also at exit).
    """
    options = (options or HybridOptions()).for_strategy(strategy)
    device = torch.device(device)
    lay = source.layout
    slots = resolve_cache_slots(cache_size, source.num_layers, source.num_experts, per_layer)
    fraction, fraction_source = resolve_fetch_fraction(options, dtype=lay.dtype, hidden_size=lay.hidden_size,
                                                       intermediate_size=lay.intermediate_size, device=device)
    if strategy == "cpu":
        fraction_source = "strategy cpu"
    host = HostExperts.create_filled(source, staging_device=device if device.type == "cuda" else None,
                                     before_fill=options.place_store)
    try:
        pool = start_cpu_pool(host, options, top_k)
        try:
            backend = HybridExperts(host, slots, device, pool, strategy=strategy, fetch_fraction=fraction,
                                    fetch_round=options.fetch_round, promote=options.promote, seed=options.seed,
                                    per_layer=per_layer, mode=mode, cpu_max_tokens=options.cpu_max_tokens)
        except BaseException:
            pool.close()
            raise
    except BaseException:
        host.close()
        raise
    backend.fetch_fraction_source = fraction_source
    atexit.register(backend.close)      # workers stopped, the shared-memory store unlinked by its creator
    return backend
