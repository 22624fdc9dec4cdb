"""The `offload` expert backend: a GPU slot pool fed over PCIe from the host expert store."""
from ftexpert.gpu_worker.backends.offload.host_store import HostExperts
from ftexpert.gpu_worker.backends.offload.offload_experts import OffloadExperts
from ftexpert.gpu_worker.backends.offload.slot_pool import resolve_cache_slots

__all__ = ["HostExperts", "OffloadExperts", "resolve_cache_slots"]
