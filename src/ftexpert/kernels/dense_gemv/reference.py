"""Plain torch reference of `linear_gemv`: the oracle of the lockstep tests, and the CPU path."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_gemv_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                          up: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ b) -> [T, N] in x.dtype: x [T, K], w [N, K], b [N], products, sums and the bias in fp32, one
    rounding to x.dtype at the end (what cuBLAS does for bf16 / fp16 with an fp32 compute type and its bias
    epilogue). up [T, K]: x is a gate, the input silu(x) * up in x.dtype (next_decode's silu_mul)."""
    if up is not None:
        x = F.silu(x) * up
    y = x.float() @ w.float().T
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)
