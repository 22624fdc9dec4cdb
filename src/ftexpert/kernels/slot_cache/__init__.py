"""The expert slot cache: which routed experts are on the GPU, which are fetched, which go to the CPU.

Contract: docs/slot_cache.md. Misses are fetched most recently routed first (ties: the lowest id).
The names below load on first use (PEP 562), so that `ft bench kernels`' command-line module, which lives in this
package, does not import torch into every `ft` command that builds the parser.
"""
import importlib

# (the audit is imported from its module, `slot_cache.audit`: a package attribute of that name is the submodule)
_EXPORTS = {"ensure": "api", "prefetch_ensure": "api", "prefetch_score": "api", "raise_on_error": "api",
            "set_policy": "api", "ROUND_MODES": "state", "SlotCache": "state", "reset": "state"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
