"""`make_expert_backend`: the one place that turns ``--moe-strategy`` into an `ExpertBackend`.

To add a backend, build it here from the `ExpertSource` (which fills packed [E, N] layers wherever
the backend wants them) and return an `ExpertBackend` (expert_backend.py). ``cpu`` and ``hybrid``
live in gpu_worker/backends/hybrid (docs/HYBRID.md).
"""
from __future__ import annotations

import atexit

import torch

from ftexpert.gpu_worker.backends.offload import HostExperts, OffloadExperts, resolve_cache_slots
from ftexpert.gpu_worker.checkpoint.expert_sources import ExpertSource
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.backends.resident import ResidentExperts

STRATEGIES = ("resident", "offload", "cpu", "hybrid")


class BackendNotAvailableError(RuntimeError):
    """A --moe-strategy that is named in the design but not built yet."""


def make_expert_backend(strategy: str, source: ExpertSource, device: torch.device | str,
                        cache_size: int | float | str | None = None, mode: str = "auto",
                        per_layer: bool = False, hybrid=None, top_k: int | None = None, split_copy: bool = True,
                        freq_weight: int | None = None, freq_half_life: int | None = None) -> ExpertBackend:
    """Build the expert backend for ``strategy`` on ``device``.

    cache_size: GPU expert slots for ``offload``, ``cpu`` and ``hybrid``: a count, or a fraction in
        (0, 1] of all experts (default 0.25); ignored by ``resident``, which holds all experts.
    per_layer: give every layer its own pool of cache_size // num_layers slots.
    mode: ``ResidentExperts`` compute mode (auto | grouped | gemv).
    hybrid: ``gpu_worker.backends.hybrid.HybridOptions`` for ``cpu`` and ``hybrid`` (None: defaults).
    top_k: experts per token (sizes the CPU pool's channels); default: the source's config, else 8.
    split_copy, freq_weight, freq_half_life: ``offload``'s decode copy and eviction key (OffloadExperts).
    """
    if strategy == "resident":
        return ResidentExperts.from_source(source, device, mode=mode)
    if strategy == "offload":
        slots = resolve_cache_slots(cache_size, source.num_layers, source.num_experts, per_layer)
        device = torch.device(device)
        host = HostExperts.create_filled(source, staging_device=device if device.type == "cuda" else None)
        try:
            backend = OffloadExperts(host, slots, device, per_layer=per_layer, mode=mode, split_copy=split_copy,
                                     freq_weight=freq_weight, freq_half_life=freq_half_life)
        except BaseException:
            host.close()
            raise
        atexit.register(backend.close)     # the shared-memory store is unlinked by its creator
        return backend
    if strategy in ("cpu", "hybrid"):
        raise ValueError(f"--moe-strategy {strategy} attaches to an expert store and CPU workers that the "
                         f"coordinator's ExpertResources creates (coordinator/expert_resources.py): build it with "
                         f"build_engine(spec, attachment=Attachment(...)) (gpu_worker/assembly/build.py)")
    raise ValueError(f"--moe-strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
