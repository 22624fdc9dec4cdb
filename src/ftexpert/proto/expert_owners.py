"""Which CPU worker computes which experts: an owner map [L, E] of worker indices.

Shared by the store's owner, which binds each expert's pages to the NUMA node of the worker that owns it
under the default split (contiguous expert ranges: cpu_expert_pool/topology.py place_store_for_workers),
and the GPU worker's CpuPool, which routes each CPU-assigned triple to its owner's channel and may
re-split in proportion to measured worker speeds (set_shares).
"""
from __future__ import annotations

import numpy as np

OWNER_DTYPE = np.dtype("<i2")


class ExpertSplit:
    def __init__(self, owner: np.ndarray, num_workers: int):
        # owner: [L, E] int16 worker index per (layer, expert)
        if owner.ndim != 2:
            raise ValueError(f"owner map must be [layers, experts], got shape {owner.shape}")
        if owner.size and (owner.min() < 0 or owner.max() >= num_workers):
            raise ValueError(f"owner map names workers outside [0, {num_workers})")
        self.owner = owner.astype(OWNER_DTYPE, copy=False)
        self.num_workers = num_workers

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_workers: int) -> "ExpertSplit":
        """Worker w owns experts [w*E/N, (w+1)*E/N) of every layer."""
        if num_workers <= 0:
            raise ValueError(f"num_workers must be > 0, got {num_workers}")
        row = (np.arange(num_experts) * num_workers) // num_experts
        return cls(np.tile(row, (num_layers, 1)), num_workers)

    @classmethod
    def proportional(cls, num_layers: int, num_experts: int, shares: list[float]) -> "ExpertSplit":
        """Contiguous expert ranges sized by `shares` (one per worker; normalised; >= 0).

        Worker w owns the experts whose index falls in its slice of [0, E) by cumulative share,
        rounded to whole experts, so a worker with twice the share owns about twice the experts.
        """
        weights = np.asarray(shares, dtype=np.float64)
        if weights.ndim != 1 or weights.size == 0:
            raise ValueError("shares must be a non-empty list, one per worker")
        if not np.all(np.isfinite(weights)) or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"shares must be finite, >= 0 and not all 0, got {list(shares)}")
        bounds = np.rint(np.cumsum(weights) / weights.sum() * num_experts).astype(np.int64)
        row = np.searchsorted(bounds, np.arange(num_experts), side="right")   # [E] owner index
        return cls(np.tile(row, (num_layers, 1)), int(weights.size))

    @classmethod
    def from_bytes(cls, data: bytes, num_layers: int, num_experts: int, num_workers: int) -> "ExpertSplit":
        expected = num_layers * num_experts * OWNER_DTYPE.itemsize
        if len(data) != expected:
            raise ValueError(f"owner map is {len(data)} bytes, expected {expected} (int16 [{num_layers} x "
                             f"{num_experts}])")
        return cls(np.frombuffer(data, dtype=OWNER_DTYPE).reshape(num_layers, num_experts).copy(), num_workers)

    def to_bytes(self) -> bytes:
        return self.owner.astype(OWNER_DTYPE).tobytes()

    def num_owned(self, worker: int) -> int:
        return int((self.owner == worker).sum())

    def split_triples(self, layer: int, expert_id: np.ndarray) -> list[np.ndarray]:
        """Indices of the triples each worker computes: list over workers of int64 index arrays."""
        owners = self.owner[layer][np.asarray(expert_id, dtype=np.int64)]
        return [np.flatnonzero(owners == w) for w in range(self.num_workers)]

    def foreign_count(self, layer: int, expert_id: np.ndarray, worker: int) -> int:
        """How many of these triples belong to another worker."""
        return int((self.owner[layer][np.asarray(expert_id, dtype=np.int64)] != worker).sum())
