"""`KVCache`: one fixed allocation for every running request's keys and values.

    k, v: [L, B, S, Hkv, D]    L layers that keep K/V (cfg.num_kv_layers: all; qwen3_next: its full-attention
                               ones), B = max_running_requests rows (one per request slot),
                               S = max_context_tokens, Hkv kv heads, D head_dim

A request owns one row (its slot) from admission to finish; token t of that request lives at
[:, slot, t]. Fixed shapes keep the decode step capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.checkpoint.config import MoeConfig


class KVCache:
    def __init__(self, cfg: MoeConfig, max_batch: int, max_context_tokens: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers, self.max_batch = cfg.num_kv_layers, max_batch
        self.max_context_tokens = max_context_tokens
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        shape = (cfg.num_kv_layers, max_batch, max_context_tokens, cfg.num_kv_heads, cfg.head_dim)
        need = self.nbytes_for(cfg, max_batch, max_context_tokens, dtype)
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            if need > free_bytes:
                raise RuntimeError(
                    f"the KV cache needs {need / 2**30:.2f} GiB ({max_batch} requests x "
                    f"{max_context_tokens} tokens) but {device} has {free_bytes / 2**30:.2f} GiB free; "
                    f"lower max_running_requests or max_context_tokens")
        # Zero-filled, not empty: rows the decode step reads but masks out must hold finite values.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def nbytes_for(cfg: MoeConfig, max_batch: int, max_context_tokens: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_kv_layers * max_batch * max_context_tokens * cfg.kv_size * elem

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer views with rows and positions merged: k, v [B*S, Hkv, D] (index slot*S + pos)."""
        B, S = self.max_batch, self.max_context_tokens
        return (self.k[layer].view(B * S, self.num_kv_heads, self.head_dim),
                self.v[layer].view(B * S, self.num_kv_heads, self.head_dim))
