"""The expert slot cache: which routed experts are on the GPU, which are fetched, which go to the CPU.

Contract: docs/slot_cache.md. Misses are fetched most recently routed first (ties: the lowest id).
"""
from ftexpert.kernels.slot_cache.api import ensure, prefetch_ensure, raise_on_error, set_policy
from ftexpert.kernels.slot_cache.audit import audit
from ftexpert.kernels.slot_cache.state import ROUND_MODES, SlotCache, reset

__all__ = ["SlotCache", "audit", "ensure", "prefetch_ensure", "reset", "set_policy", "raise_on_error",
           "ROUND_MODES"]
