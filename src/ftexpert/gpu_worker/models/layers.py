"""Stateless building blocks: RMSNorm, rotary embeddings, routers.

Numerics follow transformers' implementations (fp32 statistics, cast back before the weight) so a
float32 forward matches it to rounding.
"""
from __future__ import annotations

import math
from typing import Any

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


def yarn_inv_freq(head_dim: int, theta: float, rope: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, attention scaling) of YaRN (rope_type yarn), or of the default RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.get("rope_type", "default") == "default":
        return inv, 1.0
    dim = head_dim
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    if factor is None:
        factor = max_positions / original
    factor = float(factor)
    scaling = rope.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv, float(scaling)


class ScaledRotaryTable(RotaryTable):
    """cos/sin [P, D] fp32 from given inverse frequencies, times the attention scaling (YaRN's mscale)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, device: torch.device | str):
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]                       # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                         # [P, D]
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)
        self.max_positions = max_positions


def rotary_table(cfg: MoeConfig, dim: int, max_positions: int, device: torch.device | str) -> RotaryTable:
    """The model's rotary table over `dim` (head_dim, or the rotary share of it): YaRN's scaled frequencies
    and attention scaling where config.json asks for them (cfg.rope_scaling), else the default RoPE."""
    if not cfg.rope_scaling:
        return RotaryTable(dim, cfg.rope_theta, max_positions, device)
    inv, scaling = yarn_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    return ScaledRotaryTable(inv, scaling, max_positions, device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D] -> [T, heads, D]."""
    return x * cos + _rotate_half(x) * sin


def route(cfg: MoeConfig, x: torch.Tensor, router_weight: torch.Tensor, logits: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing. x [T, H], router_weight [E, H] -> (topk_ids [T, K] int64, topk_weights [T, K] fp32);
    ``logits`` [T, E]: x's router logits where the caller has them already (a fused projection), else computed here.

    qwen3 / olmoe: softmax over all experts, top-k, renormalise when ``norm_topk_prob``.
    mixtral: top-k of the logits, softmax over those k (= softmax, top-k, renormalise).
    """
    if logits is None:
        logits = F.linear(x, router_weight)                             # [T, E]
    if cfg.arch == "mixtral":
        top_logits, topk_ids = torch.topk(logits.float(), cfg.top_k, dim=-1)
        return topk_ids, torch.softmax(top_logits, dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)          # [T, E]
    topk_weights, topk_ids = torch.topk(probs, cfg.top_k, dim=-1)       # [T, K]
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights
