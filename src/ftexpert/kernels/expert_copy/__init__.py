"""Execute a slot-cache copy plan on the device: host expert rows -> GPU slots, no host sync.

The DMA path (`gpu_worker/backends/offload`) reads the plan on the host to issue cudaMemcpyAsync calls; this
kernel reads the plan from device memory and copies through mapped (registered) host memory, so an
offload decode step can be captured in a CUDA graph. It spends SMs on the copy, where DMA does not.
"""
from ftexpert.kernels.expert_copy.api import copy_plan

__all__ = ["copy_plan"]
