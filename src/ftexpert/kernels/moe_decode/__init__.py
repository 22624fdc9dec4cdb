"""Decode-path kernels: the MoE FFN read in place (`moe_gemv`), fused RMSNorm / residual add +
RMSNorm, qwen3 q/k norm + rotary embedding, and top-k routing; `moe_gemv_quant` / `dequantize_rows` over
quantized expert slots (quant.py, proto/expert_format.py's layouts) -- each a Triton kernel with a plain
torch reference beside it (reference.py), dispatched by api.py (Triton on CUDA, reference on CPU).

They exist to cut the number of kernels a decode step launches and the bytes it moves: the gather
FFN copied the T*K routed experts before its batched GEMV; the torch norm / rope / router code is
~6 small kernels per op. Numerics follow the torch code they replace (same rounding points).
"""
from ftexpert.kernels.moe_decode.api import (DEFAULT_GEMV_BLOCKS, CopyPlan, GemvBlocks, KvWrite, add_rms_norm, moe_gemv, qk_norm_rope, rms_norm,
                  rope, route_topk)
from ftexpert.kernels.moe_decode.quant import DequantBlocks, dequantize_rows, moe_gemv_quant

__all__ = ["moe_gemv", "CopyPlan", "rms_norm", "add_rms_norm", "qk_norm_rope", "rope", "route_topk", "GemvBlocks", "KvWrite",
           "DEFAULT_GEMV_BLOCKS", "moe_gemv_quant", "dequantize_rows", "DequantBlocks"]
