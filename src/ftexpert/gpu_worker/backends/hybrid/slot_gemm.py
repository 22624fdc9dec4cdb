"""`SlotGemm`: the hybrid backend's expert GEMMs over slot ids, with the mode rule of `ResidentExperts` (`pick_mode`).

Routes left to the CPU are -1. In the gemv mode (moe_gemv) such a route is skipped and adds exactly 0. The grouped
mode reads slot 0 with weight 0 instead: the pool starts zeroed and only ever receives real experts, so every slot
holds finite values and such a route adds 0 too (never 0 * NaN); the sums are the same.
Legend: T tokens, K top-k, H hidden.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.backends.expert_math import ExpertRows
from ftexpert.gpu_worker.backends.expert_compute import GRAPH_SAFE_MODES, pick_mode
from ftexpert.kernels import handoff as kernels_handoff


class SlotGemm:
    """rows: the expert math over the slot pool (expert_math.expert_rows); mode: auto | grouped | gemv (expert_compute.MODES);
    gather_max_pairs: the largest call the gemv mode takes under auto."""

    def __init__(self, rows: ExpertRows, *, on_cuda: bool, mode: str, gather_max_pairs: int):
        self.rows, self.on_cuda = rows, on_cuda
        self.mode, self.gather_max_pairs = mode, gather_max_pairs
        self.kernel_impl = "auto"     # moe_gemv: Triton on CUDA, reference on CPU ("triton": tests)

    def mode_for(self, num_pairs: int) -> str:
        return pick_mode(self.mode, self.on_cuda, num_pairs, self.gather_max_pairs)

    def decode_sized(self, num_pairs: int) -> bool:
        """Decode-sized: the GEMMs run in a graph-safe mode (no host sync, fixed shapes), and the device hand-off's
        count kernel takes the call (kernels.handoff.COUNT_MAX_PAIRS)."""
        return (num_pairs <= min(self.gather_max_pairs, kernels_handoff.COUNT_MAX_PAIRS)
                and self.mode in ("auto", *GRAPH_SAFE_MODES))

    def ffn(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, skip: bool) -> torch.Tensor:
        """sum_k w_k * FFN_{slot_k}(x) over slot ids [T, K] -> [T, H] (x.dtype); zeros when `skip`."""
        if skip:
            return torch.zeros_like(x)
        return self.rows.ffn(self.mode_for(slot_ids.numel()), x, slot_ids, weights, kernel_impl=self.kernel_impl)

    def ffn_gpu_routes(self, x: torch.Tensor, routes: torch.Tensor, weights: torch.Tensor,
                       skip: bool) -> torch.Tensor:
        """`ffn` over routes some of which are -1 (the CPU's): gemv skips them (adds exactly 0); the grouped mode
        reads slot 0 with weight 0 (the module docstring says why that adds 0 too)."""
        if self.mode_for(routes.numel()) == "gemv":
            return self.ffn(x, routes, weights, skip=skip)
        valid = routes >= 0
        return self.ffn(x, torch.where(valid, routes, 0), torch.where(valid, weights, 0.0), skip=skip)
