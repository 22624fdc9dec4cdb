"""Decode-sized dense linear layer: `linear_gemv(x, w)` = x @ w.T for T <= MAX_T tokens, a Triton
GEMV that streams each weight row once for all T tokens (fp32 accumulation, one rounding at the
end), with a plain torch reference beside it (reference.py), dispatched by api.py (Triton on CUDA,
reference on CPU).

It replaces cuBLAS `F.linear` for the decode step's dense projections (qwen3-30b-a3b: qkv
[5120, 2048], o_proj [2048, 4096], router [128, 2048]), which are purely bandwidth bound at T = 1..4
and where cuBLAS reaches well under half of the H200's HBM bandwidth.
"""
from ftexpert.kernels.dense_gemv.api import DEFAULT_LINEAR_BLOCKS, MAX_T, LinearBlocks, linear_gemv, pick_blocks, preferred

__all__ = ["linear_gemv", "LinearBlocks", "DEFAULT_LINEAR_BLOCKS", "MAX_T", "pick_blocks", "preferred"]
