"""gpt-oss's stateless pieces: its RMSNorm and the biased top-k router (its YaRN rotary table: layers.py).

Numerics follow transformers' GptOss modules (modeling_rope_utils._compute_yarn_parameters, GptOssTopKRouter).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels.next_decode.reference import offset_rms_norm



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
