"""The expert seam and its simplest backend.

Every MoE layer routes, then calls ``experts.forward(layer_idx, x, topk_ids, topk_weights)``:

    x:            [T, H]  hidden states after the post-attention norm (model dtype)
    topk_ids:     [T, K]  int64 expert ids in 0..E-1
    topk_weights: [T, K]  float32 routing weights
    returns       [T, H]  sum_k w_k * down(silu(gate x) * up x), model dtype

`ResidentExperts` keeps every expert in device memory, one packed [E, N] tensor per layer
(expert_layout). Two ways to compute, same result:
- ``grouped``: sort the (token, expert) pairs by expert and run one GEMM pair per routed expert.
  One host sync per layer (the per-expert counts); reads each routed expert once. For prefill.
- ``gather``: gather the K routed experts of every token and run batched GEMVs. No host sync and
  fixed shapes (CUDA-graph capturable), but it copies T*K experts; for small decode batches.
``auto`` takes ``gather`` on CUDA when T*K <= gather_max_pairs (default 32, settable), else
``grouped``. Forcing ``gather`` (mode="gather") applies to prefill too, where a long prompt would copy
T*K experts: meant for tests and for capturing decode graphs.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .expert_layout import ExpertLayout, unpack_experts
from .expert_sources import ExpertSource

MODES = ("auto", "grouped", "gather")


class ExpertBackend(Protocol):
    num_layers: int
    num_experts: int
    layout: ExpertLayout

    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]; see the module docstring."""


def grouped_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference-quality MoE FFN, one GEMM pair per routed expert (host sync for the counts).

    x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    T, K = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)                                   # [P = T*K]
    order = torch.argsort(flat_ids, stable=True)                      # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # host sync
    x_sorted = x.index_select(0, order // K)                          # [P, H]
    y_sorted = torch.empty(T * K, x.shape[1], dtype=torch.float32, device=x.device)  # [P, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        h = F.linear(x_sorted[start:start + count], w13[expert])      # [C, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]                       # [C, I]
        y_sorted[start:start + count] = F.linear(h, w2[expert])       # [C, H]
        start += count
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)    # back to (token, k) order
    # Weighted sum over k in a fixed order: deterministic, no atomics.
    return (y.view(T, K, -1) * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def gathered_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same FFN with fixed shapes and no host sync: gathers T*K expert weight copies.

    x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    T, K = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)                                   # [P = T*K]
    xp = x.unsqueeze(1).expand(T, K, x.shape[1]).reshape(T * K, -1, 1)  # [P, H, 1], pair p = t*K + k
    h = torch.bmm(w13.index_select(0, flat_ids), xp).squeeze(2)       # [P, 2I]
    h = (F.silu(h[:, :inter]) * h[:, inter:]).unsqueeze(2)            # [P, I, 1]
    y = torch.bmm(w2.index_select(0, flat_ids), h).squeeze(2)         # [P, H]
    y = y.float() * topk_weights.reshape(-1, 1)                       # [P, H] fp32
    return y.view(T, K, -1).sum(dim=1).to(x.dtype)                    # [T, H]


class ResidentExperts:
    """All experts in device memory; ``packed[l]`` is layer l's [E, N] tensor."""

    def __init__(self, packed: list[torch.Tensor], layout: ExpertLayout, mode: str = "auto",
                 gather_max_pairs: int = 32):
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        for p in packed:
            layout.check(p)
        self.packed, self.layout, self.mode = packed, layout, mode
        self.gather_max_pairs = gather_max_pairs
        self.num_layers = len(packed)
        self.num_experts = packed[0].shape[0] if packed else 0
        self._views = [unpack_experts(p, layout) for p in packed]    # (w13, w2) per layer, no copy

    @classmethod
    def from_source(cls, source: ExpertSource, device: torch.device | str, mode: str = "auto",
                    gather_max_pairs: int = 32) -> "ResidentExperts":
        """Allocate each layer on ``device`` and let the source fill it in place."""
        packed = []
        for layer in range(source.num_layers):
            out = source.layout.empty_layer(source.num_experts, device=device)
            source.fill_layer(layer, out)
            packed.append(out)
        return cls(packed, source.layout, mode=mode, gather_max_pairs=gather_max_pairs)

    def weights(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) views of one layer."""
        return self._views[layer_idx]

    def choose_mode(self, num_pairs: int, device: torch.device) -> str:
        if self.mode != "auto":
            return self.mode
        return "gather" if device.type == "cuda" and num_pairs <= self.gather_max_pairs else "grouped"

    def graph_safe(self, num_pairs: int) -> bool:
        """Capturable in a CUDA graph for this many (token, expert) pairs: the gather mode."""
        return self.choose_mode(num_pairs, self.packed[0].device) == "gather"

    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self._views[layer_idx]
        if self.choose_mode(topk_ids.numel(), x.device) == "gather":
            return gathered_expert_ffn(x, topk_ids, topk_weights, w13, w2)
        return grouped_expert_ffn(x, topk_ids, topk_weights, w13, w2)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.packed)
