"""Shared helpers for the CPU-pool tests."""
from __future__ import annotations

import torch

from proto.expert_store import ExpertStore


def random_store(name: str, *, num_layers: int, num_experts: int, hidden: int, intermediate: int,
                 config_hash: str, seed: int = 0) -> ExpertStore:
    """A ready bf16 store of seeded random experts, scaled like a real layer (std 1/sqrt(H))."""
    store = ExpertStore.create(name, num_layers=num_layers, num_experts=num_experts, hidden=hidden,
                               intermediate=intermediate, dtype=torch.bfloat16, config_hash=config_hash)
    g = torch.Generator().manual_seed(seed)
    for layer in range(num_layers):
        rows = torch.randn(num_experts, store.shape.expert_numel, generator=g) / hidden ** 0.5
        store.write_layer(layer, rows.to(torch.bfloat16))
    store.mark_ready()
    return store
