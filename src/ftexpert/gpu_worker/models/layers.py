"""Stateless building blocks: RMSNorm, rotary embeddings, routers.

Numerics follow transformers' implementations (fp32 statistics, cast back before the weight) so a
float32 forward matches it to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.gpu_worker.checkpoint.config import MoeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RotaryTable:
    """cos/sin for positions 0..max_positions-1: [P, D] in fp32, gathered by a device tensor."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device | str):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]                       # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                         # [P, D]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int64, device) -> cos, sin [T, 1, D] in ``dtype`` (no host sync)."""
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D] -> [T, heads, D]."""
    return x * cos + _rotate_half(x) * sin


def route(cfg: MoeConfig, x: torch.Tensor, router_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing. x [T, H], router_weight [E, H] -> (topk_ids [T, K] int64, topk_weights [T, K] fp32).

    qwen3 / olmoe: softmax over all experts, top-k, renormalise when ``norm_topk_prob``.
    mixtral: top-k of the logits, softmax over those k (= softmax, top-k, renormalise).
    """
    logits = F.linear(x, router_weight)                                 # [T, E]
    if cfg.arch == "mixtral":
        top_logits, topk_ids = torch.topk(logits.float(), cfg.top_k, dim=-1)
        return topk_ids, torch.softmax(top_logits, dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)          # [T, E]
    topk_weights, topk_ids = torch.topk(probs, cfg.top_k, dim=-1)       # [T, K]
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights
