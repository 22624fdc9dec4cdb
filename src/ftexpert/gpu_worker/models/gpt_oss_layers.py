"""gpt-oss's stateless pieces: YaRN rotary frequencies and the biased top-k router.

Numerics follow transformers' GptOss modules (modeling_rope_utils._compute_yarn_parameters, GptOssTopKRouter).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ftexpert.kernels.next_decode.reference import offset_rms_norm

from ftexpert.gpu_worker.models.layers import RotaryTable


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


def gpt_oss_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GptOssRMSNorm: fp32 statistics and the weight applied in fp32, then cast to x's dtype (the (offset + w) norm
    of kernels/next_decode with offset 0)."""
    return offset_rms_norm(x, weight, eps, offset=0.0)


def gpt_oss_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (topk_ids [T, K] int64, topk_weights [T, K] fp32): top-k of the biased logits, softmax over
    those k (in the logits' dtype, as transformers does, then fp32)."""
    logits = F.linear(x, weight, bias)                                  # [T, E]
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=top.dtype).float()
