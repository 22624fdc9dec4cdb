"""The simplest expert backend: `ResidentExperts` keeps every expert in device memory, one packed [E, N] tensor
per layer (expert_layout).

Every MoE layer routes, then calls ``experts.forward(layer_idx, x, topk_ids, topk_weights)``
(`ExpertBackend`, expert_backend.py). The FFN's two modes (``grouped`` for prefill, ``gemv`` for small decode
batches) and the rule that picks one (`pick_mode`: ``auto`` takes ``gemv`` on CUDA when T*K <= gather_max_pairs,
here RESIDENT_GEMV_MAX_PAIRS = 128, settable) are in expert_compute.py, shared with the offload and hybrid backends.

Quantized experts (``layout.fmt``: fp8, int4-g*, mxfp4, nvfp4) are held as their bytes, one uint8 row an expert,
and computed through the same seam as every backend's (expert_math.py: dequantize the routed rows to the model
dtype, then this math, until the fast kernels land).
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.backends.expert_compute import GRAPH_SAFE_MODES, MODES, pick_mode
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout
from ftexpert.gpu_worker.backends.expert_math import expert_rows
from ftexpert.gpu_worker.checkpoint.expert_sources import ExpertSource


# auto's gemv bound for resident experts, in (token, expert) pairs: qwen3-30b-a3b bf16 at batch 16 (128 pairs) decodes
# 1,005.9 tok/s with gemv in the CUDA graphs against 831.9 with the grouped GEMMs in them and 196.6 eagerly (H100,
# `BATCH_SIZES="1 16" bash bench/run_gpu.sh batch`, docs/BENCHMARKS.md "Decode at batch"). Offload and hybrid keep
# 32: their decode copy plans are sized by it.
RESIDENT_GEMV_MAX_PAIRS = 128


class ResidentExperts(ExpertBackend):
    """All experts in device memory; ``packed[l]`` is layer l's [E, N] tensor."""

    def __init__(self, packed: list[torch.Tensor], layout: ExpertLayout, mode: str = "auto",
                 gather_max_pairs: int = RESIDENT_GEMV_MAX_PAIRS):
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        for p in packed:
            layout.check(p)
        self.packed, self.layout, self.mode = packed, layout, mode
        self.gather_max_pairs = gather_max_pairs
        self.num_layers = len(packed)
        self.num_experts = packed[0].shape[0] if packed else 0
        self.rows = [expert_rows(p, layout) for p in packed]          # the expert math over each layer's rows
        self.kernel_impl = "auto"     # moe_gemv: Triton on CUDA, reference on CPU ("triton": tests)
        self._grouped_capturable: bool | None = None     # graph_safe's answer for the grouped mode, once known

    @classmethod
    def from_source(cls, source: ExpertSource, device: torch.device | str, mode: str = "auto",
                    gather_max_pairs: int = RESIDENT_GEMV_MAX_PAIRS) -> "ResidentExperts":
        """Allocate each layer on ``device`` and let the source fill it in place."""
        packed = []
        for layer in range(source.num_layers):
            out = source.layout.empty_layer(source.num_experts, device=device)
            source.fill_layer(layer, out)
            packed.append(out)
        return cls(packed, source.layout, mode=mode, gather_max_pairs=gather_max_pairs)

    def choose_mode(self, num_pairs: int, device: torch.device) -> str:
        return pick_mode(self.mode, device.type == "cuda", num_pairs, self.gather_max_pairs)

    def graph_safe(self, num_pairs: int) -> bool:
        """Capturable in a CUDA graph for this many (token, expert) pairs: the gemv mode, and the grouped mode where
        every layer's rows take it without a host sync (bf16 on Hopper+, expert_compute.grouped_capturable)."""
        mode = self.choose_mode(num_pairs, self.packed[0].device)
        if mode in GRAPH_SAFE_MODES:
            return True
        if self._grouped_capturable is None:
            self._grouped_capturable = all(r.grouped_capturable for r in self.rows)
        return self._grouped_capturable

    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, partials: bool = False) -> torch.Tensor:
        mode = self.choose_mode(topk_ids.numel(), x.device)
        return self.rows[layer_idx].ffn(mode, x, topk_ids, topk_weights, kernel_impl=self.kernel_impl,
                                        partials=partials)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.packed)
