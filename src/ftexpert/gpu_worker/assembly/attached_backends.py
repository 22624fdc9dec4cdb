"""`make_attached_expert_backend`: the expert backend over the coordinator's expert store.

It *attaches* to the shared-memory store that the coordinator's ExpertResources
(coordinator/expert_resources.py) created and filled, by name: no second host copy, and the store is
never unlinked here (`HostExperts.attach` makes a non-owner). `resident` needs no store and is built
as usual. `cpu` and `hybrid` also attach to the CPU expert workers' channels the owner created (its
supervisor runs and restarts the workers; `CpuPool.attach` only talks to them). Used by the GPU worker
and, in one process, by `ft generate` and `ft serve --workers inline` (gpu_worker/api.py).
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.assembly.backends import make_expert_backend
from ftexpert.gpu_worker.backends.offload import HostExperts, OffloadExperts, resolve_cache_slots
from ftexpert.gpu_worker.backends.offload.host_store import layout_hash
from ftexpert.gpu_worker.checkpoint.expert_sources import ExpertSource
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend

HOST_STORE_STRATEGIES = ("offload", "cpu", "hybrid")     # strategies whose experts live in the host store
CPU_POOL_STRATEGIES = ("cpu", "hybrid")                  # ... and whose misses CPU workers compute


def needs_host_store(strategy: str) -> bool:
    return strategy in HOST_STORE_STRATEGIES


def make_attached_expert_backend(strategy: str, source: ExpertSource, device: torch.device | str, *,
                                 store_name: str = "", cpu_channels: list[str] | tuple[str, ...] = (),
                                 cache_size: int | float | str | None = None, mode: str = "auto",
                                 per_layer: bool = False, hybrid=None, worker_info=None,
                                 freq_weight: int | None = None, freq_half_life: int | None = None,
                                 split_copy: bool = True, host=None, pool=None) -> ExpertBackend:
    """The backend for ``strategy``, reading experts from the store ``store_name`` where it needs one.
    ``hybrid``: HybridOptions of cpu / hybrid (None: defaults; its reserve_cpus, the CPUs the owner kept
    free of CPU workers, sets this process's torch threads). ``worker_info``: the owner's supervisor view
    of the workers where it runs in this process (CpuPool.worker_info). ``freq_weight`` / ``freq_half_life``: the
    slot cache's eviction key (--eviction-freq-weight / --eviction-freq-half-life; None: the knobs' defaults).
    ``split_copy``: the decode copy in two parts (--expert-copy split). ``host`` / ``pool``: a store (HostExperts)
    and a CPU pool (CpuPool) already open in this process, borrowed instead of attached by name: the backend never
    closes them (a benchmark's rows over one store)."""
    if not needs_host_store(strategy):
        return make_expert_backend(strategy, source, device, cache_size=cache_size, mode=mode)
    if host is not None:
        return _over_store(strategy, host, source, device, cpu_channels, owns_host=False, pool=pool,
                           cache_size=cache_size, mode=mode, per_layer=per_layer, hybrid=hybrid,
                           worker_info=worker_info, split_copy=split_copy,
                           eviction=dict(freq_weight=freq_weight, freq_half_life=freq_half_life))
    if not store_name:
        raise ValueError(f"--moe-strategy {strategy} needs the coordinator's expert store, but no store name came "
                         f"with WELCOME (nor --store); start the coordinator with the same --moe-strategy")
    if strategy in CPU_POOL_STRATEGIES and not cpu_channels:
        raise ValueError(f"--moe-strategy {strategy} needs CPU expert workers, but WELCOME named no channels; "
                         f"start the coordinator with --moe-strategy {strategy} and --num-cpu-workers >= 1")
    host = HostExperts.attach(store_name, source.layout)
    try:
        return _over_store(strategy, host, source, device, cpu_channels, owns_host=True, cache_size=cache_size,
                           mode=mode, per_layer=per_layer, hybrid=hybrid, worker_info=worker_info,
                           split_copy=split_copy, eviction=dict(freq_weight=freq_weight, freq_half_life=freq_half_life))
    except BaseException:
        host.close()
        raise


def _over_store(strategy: str, host, source: ExpertSource, device: torch.device | str, cpu_channels, *,
                owns_host: bool, pool=None, cache_size, mode: str, per_layer: bool, hybrid, worker_info,
                split_copy: bool, eviction: dict) -> ExpertBackend:
    """offload over `host`, or cpu / hybrid over `host` and the CPU workers (`pool`, else attached by the channels'
    names); `owns_host`: closing the backend closes `host`."""
    _check_store(host, source, host.store.name)
    if strategy in CPU_POOL_STRATEGIES and pool is None and not cpu_channels:
        raise ValueError(f"--moe-strategy {strategy} needs CPU expert workers: give their pool or channels")
    slots = resolve_cache_slots(cache_size, source.num_layers, source.num_experts, per_layer)
    if strategy == "offload":
        return OffloadExperts(host, slots, torch.device(device), per_layer=per_layer, mode=mode,
                              split_copy=split_copy, owns_host=owns_host, **eviction)
    return _attached_hybrid(strategy, host, source, slots, torch.device(device), list(cpu_channels), pool=pool,
                            owns_host=owns_host, per_layer=per_layer, mode=mode, hybrid=hybrid,
                            worker_info=worker_info, split_copy=split_copy, eviction=eviction)


def _check_store(host, source: ExpertSource, store_name: str) -> None:
    expected = layout_hash(source)
    if host.store.config_hash != expected:
        raise ValueError(f"expert store {store_name!r} has config hash {host.store.config_hash!r}, this model "
                         f"needs {expected!r}: the coordinator loaded another model; start both with the same "
                         f"--model / --preset")
    if not host.store.is_ready:
        raise ValueError(f"expert store {store_name!r} is still being filled; the coordinator says WELCOME only "
                         f"after filling it, so another process is writing it: restart the coordinator")


def _attached_hybrid(strategy: str, host, source: ExpertSource, slots: int, device: torch.device,
                     channels: list[str], *, per_layer: bool, mode: str, hybrid=None, pool=None,
                     owns_host: bool = True, worker_info=None, split_copy: bool = True,
                     eviction: dict | None = None) -> ExpertBackend:
    """HybridExperts over the attached store and the coordinator's CPU workers (their channels; `pool`: already
    attached in this process, borrowed)."""
    # lazy: the hybrid backend and its ZMQ client load only where cpu / hybrid is asked for (start-up time)
    from ftexpert.gpu_worker.backends.hybrid import CpuPool, HybridExperts, HybridOptions
    from ftexpert.gpu_worker.backends.hybrid.options import resolve_fetch_fraction

    options = (hybrid or HybridOptions()).for_strategy(strategy)
    lay = source.layout
    fraction, fraction_source = resolve_fetch_fraction(options, dtype=lay.dtype, hidden_size=lay.hidden_size,
                                                       intermediate_size=lay.intermediate_size, device=device,
                                                       fmt=lay.fmt.label)
    owns_pool = pool is None
    if pool is None:
        pool = CpuPool.attach(host.store, channels, deadline_s=options.cpu_deadline_s,
                              readmit_poll_s=options.readmit_poll_s, ready_timeout_s=options.ready_timeout_s,
                              worker_info=worker_info)
    try:
        torch.set_num_threads(options.engine_thread_count())    # idle OpenMP threads would spin on their cores
        backend = HybridExperts(host, slots, device, pool, strategy=strategy, fetch_fraction=fraction,
                                fetch_round=options.fetch_round, promote=options.promote, seed=options.seed,
                                per_layer=per_layer, mode=mode, cpu_max_tokens=min(options.cpu_max_tokens, pool.t_max),
                                owns_host=owns_host, owns_pool=owns_pool, split_copy=split_copy, **(eviction or {}))
        backend.fetch_fraction_source = "strategy cpu" if strategy == "cpu" else fraction_source
        return backend
    except BaseException:
        if owns_pool:
            pool.close()
        raise
