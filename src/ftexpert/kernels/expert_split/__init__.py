"""Splitting one expert of a layer between a PCIe fetch and the CPU pool, by intermediate channels.

An expert's FFN is a sum over its I intermediate channels, so the CPU can compute channels [0, c) of
an expert while the GPU fetches and computes channels [c, I). `split_pick` decides, per layer and on
the device, which CPU-assigned expert is split and where; `split_copy` fetches the GPU's part into
the split slot (outside the slot cache). Used by the hybrid backend's device hand-off under the
`split` rounding mode (gpu_worker/backends/hybrid/hybrid_experts.py, docs/HYBRID.md).
"""
from ftexpert.kernels.expert_split.api import (COUNT_GPU_CHANNELS, COUNT_SPLITS, COUNTS_LEN, DESC_EXPERT, DESC_LEN, DESC_LIMIT, SPLIT_UNIT,
                  splittable, split_copy, split_pick)

__all__ = ["split_pick", "split_copy", "splittable", "SPLIT_UNIT", "DESC_EXPERT", "DESC_LIMIT", "DESC_LEN",
           "COUNT_SPLITS", "COUNT_GPU_CHANNELS", "COUNTS_LEN"]
