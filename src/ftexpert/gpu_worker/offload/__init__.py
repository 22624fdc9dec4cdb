"""The `offload` expert backend: a GPU slot pool fed over PCIe from the host expert store."""
from .host_store import HostExperts
from .offload_experts import OffloadExperts
from .slot_pool import resolve_cache_slots

__all__ = ["HostExperts", "OffloadExperts", "resolve_cache_slots"]
