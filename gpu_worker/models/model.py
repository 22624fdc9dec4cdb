"""`MoeModel`: the decoder forward over a flat batch of tokens.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head_dim, E experts, K top-k, V vocab.
The model knows nothing about KV caches or batching: attention is delegated to an
`AttentionContext` (engine/attention.py builds one per step), experts to an `ExpertBackend`.
Nothing in ``forward`` syncs with the host except what those two choose to do.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .config import MoeConfig
from .dense_weights import DenseWeights, LayerWeights
from .layers import RotaryTable, apply_rope, rms_norm, route
from .resident_experts import ExpertBackend


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after rope) -> [T, Hq, D]; stores k/v where it keeps them."""


class MoeModel:
    def __init__(self, cfg: MoeConfig, dense: DenseWeights, experts: ExpertBackend, max_positions: int):
        if experts.num_layers != cfg.num_layers or experts.num_experts != cfg.num_experts:
            raise ValueError(f"expert backend has {experts.num_layers} layers x {experts.num_experts} "
                             f"experts; the model needs {cfg.num_layers} x {cfg.num_experts}")
        self.cfg, self.dense, self.experts = cfg, dense, experts
        self.device = dense.embed.device
        self.dtype = dense.embed.dtype
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, max_positions, self.device)

    def ensure_positions(self, max_positions: int) -> None:
        """Grow the rotary table to cover positions 0..max_positions-1."""
        if self.rope.max_positions < max_positions:
            self.rope = RotaryTable(self.cfg.head_dim, self.cfg.rope_theta, max_positions, self.device)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids, positions [T] int64 (device) -> logits [R, V] float32.

        logit_rows [R] int64 selects the tokens whose logits are computed (e.g. the last token of each
        sequence); None computes all T.
        """
        x = F.embedding(token_ids, self.dense.embed)                    # [T, H]
        cos, sin = self.rope.lookup(positions, self.dtype)              # [T, 1, D]
        for i, layer in enumerate(self.dense.layers):
            x = x + self._attention(i, layer, rms_norm(x, layer.attn_norm, self.cfg.rms_norm_eps),
                                    cos, sin, attn)
            x = x + self._moe(i, layer, rms_norm(x, layer.mlp_norm, self.cfg.rms_norm_eps))
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)                           # [R, H]
        x = rms_norm(x, self.dense.final_norm, self.cfg.rms_norm_eps)
        return F.linear(x, self.dense.lm_head).float()                  # [R, V]

    def _attention(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        q = F.linear(h, layer.q_proj)                                   # [T, Hq*D]
        k = F.linear(h, layer.k_proj)                                   # [T, Hkv*D]
        v = F.linear(h, layer.v_proj)                                   # [T, Hkv*D]
        if cfg.arch == "olmoe":                                         # norm over the whole projection
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            if cfg.clip_qkv is not None:
                q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)                      # [T, Hq, D]
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)                   # [T, Hkv, D]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)                   # [T, Hkv, D]
        if cfg.arch == "qwen3":                                         # norm per head
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn.attend(i, q, k, v)                                   # [T, Hq, D]
        return F.linear(out.reshape(T, cfg.q_size), layer.o_proj)       # [T, H]

    def _moe(self, i: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = route(self.cfg, h, layer.router)       # [T, K], [T, K]
        return self.experts.forward(i, h, topk_ids, topk_weights)       # [T, H]
