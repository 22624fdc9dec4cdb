"""The `hybrid` and `cpu` expert backends: misses split between PCIe fetches and the CPU expert pool.

Names are imported on first use (PEP 562), so that `ft --help`, which imports the `ft bench bw`
module of this package, does not load torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"CpuPool": "cpu_pool", "HybridExperts": "hybrid_experts", "HybridOptions": "options",
            "HybridStats": "stats"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
