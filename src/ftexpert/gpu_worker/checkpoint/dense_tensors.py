"""The dense weights' containers: `DenseWeights` (embeddings, layers, final norm, lm head), the layers of
qwen3 / olmoe / mixtral / gpt-oss (`LayerWeights`; Qwen3-Next's are in qwen3_next_weights.py) and `fuse_qkv`.
dense_weights.py reads, generates and writes them, handing Qwen3-Next to qwen3_next_weights.py, which takes
the containers from here (not from dense_weights.py: that would be an import cycle).

Kept as plain tensors in dataclasses (no nn.Module): the GPU worker owns them, CUDA graphs capture
them, and the prefetch predictor reads ``layers[l].router`` directly.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor          # [H]
    q_proj: torch.Tensor             # [Hq*D, H]
    k_proj: torch.Tensor             # [Hkv*D, H]
    v_proj: torch.Tensor             # [Hkv*D, H]
    o_proj: torch.Tensor             # [H, Hq*D]
    mlp_norm: torch.Tensor           # [H]
    router: torch.Tensor             # [E, H]
    q_norm: torch.Tensor | None = None   # qwen3: [D]; olmoe: [Hq*D]
    k_norm: torch.Tensor | None = None   # qwen3: [D]; olmoe: [Hkv*D]
    # gpt-oss: projection biases (attention_bias), the router's bias [E] and the attention sinks [Hq]
    q_bias: torch.Tensor | None = None   # [Hq*D]
    k_bias: torch.Tensor | None = None   # [Hkv*D]
    v_bias: torch.Tensor | None = None   # [Hkv*D]
    o_bias: torch.Tensor | None = None   # [H]
    router_bias: torch.Tensor | None = None   # [E]
    sinks: torch.Tensor | None = None    # [Hq]
    # [Hq*D + 2*Hkv*D, H] after fuse_qkv (one GEMM for q, k, v); q_proj/k_proj/v_proj are then
    # row views of it. Never read from or written to a checkpoint.
    qkv_proj: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None     # likewise [Hq*D + 2*Hkv*D] where the projections have biases


@dataclass
class DenseWeights:
    embed: torch.Tensor              # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor         # [H]
    lm_head: torch.Tensor            # [V, H] (the embedding itself when tied)

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += [getattr(layer, f.name) for f in fields(layer)]
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def fuse_rows(layer, whole: str, parts: tuple[str, ...]) -> None:
    """Concatenate the tensors of fields ``parts`` of ``layer`` along dim 0 into field ``whole`` and make the parts row
    views of it (no second copy is kept): one GEMM where there were len(parts). Values are unchanged. Nothing to do
    where ``whole`` is set already or a part is None."""
    tensors = [getattr(layer, name) for name in parts]
    if getattr(layer, whole) is not None or any(t is None for t in tensors):
        return
    fused = torch.cat(tensors, dim=0)
    for name, view in zip(parts, fused.split([t.shape[0] for t in tensors], dim=0)):
        setattr(layer, name, view)
    setattr(layer, whole, fused)


def fuse_qkv(weights: DenseWeights) -> None:
    """Concatenate each layer's q/k/v projections into ``qkv_proj`` [Hq*D + 2*Hkv*D, H] and make
    ``q_proj`` / ``k_proj`` / ``v_proj`` row views of it (`fuse_rows`), so attention runs one GEMM instead of
    three; their biases, where they have them (gpt-oss), into ``qkv_bias`` likewise. Checkpoints and state dicts read
    the views. Idempotent; one layer at a time (peak extra memory: one layer's projections)."""
    for layer in weights.layers:
        fuse_rows(layer, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        fuse_rows(layer, "qkv_bias", ("q_bias", "k_bias", "v_bias"))
