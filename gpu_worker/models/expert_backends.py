"""`make_expert_backend`: the one place that turns ``--moe-strategy`` into an `ExpertBackend`.

To add a backend (offload, cpu, hybrid), build it here from the `ExpertSource` (which fills packed
[E, N] layers wherever the backend wants them) and return an object with
``forward(layer_idx, x, topk_ids, topk_weights) -> [T, H]``.
"""
from __future__ import annotations

import torch

from .expert_sources import ExpertSource
from .resident_experts import ExpertBackend, ResidentExperts

STRATEGIES = ("resident", "offload")


class BackendNotAvailableError(RuntimeError):
    """A --moe-strategy that is named in the design but not built yet."""


def make_expert_backend(strategy: str, source: ExpertSource, device: torch.device | str,
                        cache_size: int | None = None, mode: str = "auto") -> ExpertBackend:
    """Build the expert backend for ``strategy`` on ``device``.

    cache_size: GPU expert slots for ``offload`` (ignored by ``resident``, which holds all experts).
    mode: ``ResidentExperts`` compute mode (auto | grouped | gather).
    """
    if strategy == "resident":
        return ResidentExperts.from_source(source, device, mode=mode)
    if strategy == "offload":
        raise BackendNotAvailableError(
            "--moe-strategy offload is not available yet (the expert slot-cache backend is still being "
            "wired in); use --moe-strategy resident, which needs GPU memory for every expert "
            f"({source.num_layers * source.num_experts * source.layout.expert_nbytes / 2**30:.1f} GiB "
            "for this model)")
    raise ValueError(f"--moe-strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
