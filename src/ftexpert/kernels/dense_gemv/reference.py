"""Plain torch reference of `linear_gemv`: the oracle of the lockstep tests, and the CPU path."""
from __future__ import annotations

import torch


def linear_gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T -> [T, N] in x.dtype: x [T, K], w [N, K], products and sums in fp32, one rounding
    to x.dtype at the end (what cuBLAS does for bf16 / fp16 with an fp32 compute type)."""
    return (x.float() @ w.float().T).to(x.dtype)
