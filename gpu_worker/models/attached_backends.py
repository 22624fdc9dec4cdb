"""`make_attached_expert_backend`: the GPU worker's expert backend over the coordinator's expert store.

Beside `make_expert_backend` (expert_backends.py), which builds a backend that owns its experts (the
single-process `ft generate` creates its own store), this one *attaches* to the shared-memory store
the coordinator created and filled, by name: no second host copy, and the store is never unlinked here
(`HostExperts.attach` makes a non-owner). `resident` needs no store and is built as usual.
"""
from __future__ import annotations

import torch

from .expert_backends import make_expert_backend
from .expert_sources import ExpertSource
from .resident_experts import ExpertBackend

HOST_STORE_STRATEGIES = ("offload", "cpu", "hybrid")     # strategies whose experts live in the host store


def needs_host_store(strategy: str) -> bool:
    return strategy in HOST_STORE_STRATEGIES


def make_attached_expert_backend(strategy: str, source: ExpertSource, device: torch.device | str, *,
                                 store_name: str = "", cache_size: int | float | str | None = None,
                                 mode: str = "auto", per_layer: bool = False) -> ExpertBackend:
    """The backend for ``strategy``, reading experts from the store ``store_name`` where it needs one."""
    if not needs_host_store(strategy):
        return make_expert_backend(strategy, source, device, cache_size=cache_size, mode=mode)
    if strategy != "offload":
        raise ValueError(f"--moe-strategy {strategy} is not built into the GPU worker yet (only resident and "
                         f"offload are); run with --moe-strategy offload")
    if not store_name:
        raise ValueError("--moe-strategy offload needs the coordinator's expert store, but no store name came "
                         "with WELCOME (nor --store); start the coordinator with the same --moe-strategy")
    from gpu_worker.offload import HostExperts, OffloadExperts, resolve_cache_slots
    from gpu_worker.offload.host_store import layout_hash

    slots = resolve_cache_slots(cache_size, source.num_layers, source.num_experts, per_layer)
    host = HostExperts.attach(store_name, source.layout)
    try:
        expected = layout_hash(source)
        if host.store.config_hash != expected:
            raise ValueError(f"expert store {store_name!r} has config hash {host.store.config_hash!r}, this model "
                             f"needs {expected!r}: the coordinator loaded another model; start both with the same "
                             f"--model / --preset")
        if not host.store.is_ready:
            raise ValueError(f"expert store {store_name!r} is still being filled; the coordinator says WELCOME only "
                             f"after filling it, so another process is writing it: restart the coordinator")
        return OffloadExperts(host, slots, torch.device(device), per_layer=per_layer, mode=mode)
    except BaseException:
        host.close()
        raise
