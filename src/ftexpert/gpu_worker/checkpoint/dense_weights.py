"""The dense (non-expert) weights: embeddings, attention, norms, routers, lm head.

Kept as plain tensors in dataclasses (no nn.Module): the GPU worker owns them, CUDA graphs capture
them, and the prefetch predictor reads ``layers[l].router`` directly.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ftexpert.gpu_worker.checkpoint.reader import CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.expert_sources import seeded_generator
from ftexpert.gpu_worker.checkpoint.weight_names import EMBED, FINAL_NORM, LM_HEAD, dense_layer_names, router_alt_name


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


def fuse_qkv(weights: DenseWeights) -> None:
    """Concatenate each layer's q/k/v projections into ``qkv_proj`` [Hq*D + 2*Hkv*D, H] and make
    ``q_proj`` / ``k_proj`` / ``v_proj`` row views of it (no second copy is kept), so attention runs
    one GEMM instead of three. Values are unchanged: checkpoints and state dicts read the views.
    Idempotent; one layer at a time (peak extra memory: one layer's projections)."""
    for layer in weights.layers:
        if layer.qkv_proj is not None:
            continue
        sizes = [layer.q_proj.shape[0], layer.k_proj.shape[0], layer.v_proj.shape[0]]
        qkv = torch.cat([layer.q_proj, layer.k_proj, layer.v_proj], dim=0)
        layer.q_proj, layer.k_proj, layer.v_proj = qkv.split(sizes, dim=0)
        layer.qkv_proj = qkv


def load_dense_weights(reader: CheckpointReader, cfg: MoeConfig, device: torch.device | str,
                       dtype: torch.dtype) -> DenseWeights:
    """Read every dense tensor, check its shape against ``cfg``, move it to ``device`` as ``dtype``."""
    if cfg.arch == "qwen3_next":
        from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import load_next_dense
        return load_next_dense(reader, cfg, device, dtype)
    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return reader.get(name, shape).to(device=device, dtype=dtype)

    V, H = cfg.vocab_size, cfg.hidden_size
    layers = []
    for i in range(cfg.num_layers):
        values = {}
        for field_name, (name, shape) in dense_layer_names(cfg, i).items():
            alt = router_alt_name(cfg, i) if field_name == "router" else None
            if alt is not None and not reader.has(name) and reader.has(alt):
                name = alt
            values[field_name] = get(name, shape)
        layers.append(LayerWeights(**values))
    embed = get(EMBED, (V, H))
    if cfg.tie_word_embeddings and not reader.has(LM_HEAD):
        lm_head = embed
    else:
        lm_head = get(LM_HEAD, (V, H))
    return DenseWeights(embed=embed, layers=layers, final_norm=get(FINAL_NORM, (H,)), lm_head=lm_head)


def random_dense_weights(cfg: MoeConfig, device: torch.device | str, dtype: torch.dtype, seed: int,
                         std: float = 0.02) -> DenseWeights:
    """Seeded random dense weights generated on ``device`` (norm weights are ones, as at init).

    Each tensor has its own generator keyed by (seed, layer, field), so values do not depend on the
    order of generation; they do depend on the device kind.
    """
    if cfg.arch == "qwen3_next":
        from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import random_next_dense
        return random_next_dense(cfg, device, dtype, seed, std=std)
    def normal(shape: tuple[int, ...], *key: int) -> torch.Tensor:
        out = torch.empty(shape, device=device, dtype=dtype)
        return out.normal_(0.0, std, generator=seeded_generator(device, seed, *key))

    def ones(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, device=device, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        values = {}
        for k, (field_name, (_, shape)) in enumerate(sorted(dense_layer_names(cfg, i).items())):
            is_norm = field_name.endswith("norm")
            values[field_name] = ones(shape) if is_norm else normal(shape, 2, i, k)
        layers.append(LayerWeights(**values))
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = normal((V, H), 3, 0)
    lm_head = embed if cfg.tie_word_embeddings else normal((V, H), 3, 1)
    return DenseWeights(embed=embed, layers=layers, final_norm=ones((H,)), lm_head=lm_head)


def dense_state_dict(cfg: MoeConfig, weights: DenseWeights) -> dict[str, torch.Tensor]:
    """Hub tensor names -> tensors (for writing a checkpoint)."""
    if cfg.arch == "qwen3_next":
        from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import next_dense_state_dict
        return next_dense_state_dict(cfg, weights)
    state = {EMBED: weights.embed, FINAL_NORM: weights.final_norm}
    if not cfg.tie_word_embeddings:
        state[LM_HEAD] = weights.lm_head
    for i, layer in enumerate(weights.layers):
        for field_name, (name, _) in dense_layer_names(cfg, i).items():
            state[name] = getattr(layer, field_name)
    return state
