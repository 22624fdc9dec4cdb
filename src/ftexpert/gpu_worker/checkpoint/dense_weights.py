"""The dense (non-expert) weights: embeddings, attention, norms, routers, lm head: read from a checkpoint
(`load_dense_weights`), seeded random (`random_dense_weights`) and as a state dict (`dense_state_dict`);
qwen3_next_weights.py does Qwen3-Next's. The containers (`DenseWeights`, `LayerWeights`) are in dense_tensors.py.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.checkpoint.reader import CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
# the containers live in dense_tensors.py (qwen3_next_weights.py imports them there); imported from here too
from ftexpert.gpu_worker.checkpoint.dense_tensors import DenseWeights, LayerWeights, fuse_qkv
from ftexpert.gpu_worker.checkpoint.expert_sources import seeded_generator
from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import load_next_dense, next_dense_state_dict, random_next_dense
from ftexpert.gpu_worker.checkpoint.weight_names import EMBED, FINAL_NORM, LM_HEAD, dense_layer_names, router_alt_name


def load_dense_weights(reader: CheckpointReader, cfg: MoeConfig, device: torch.device | str,
                       dtype: torch.dtype) -> DenseWeights:
    """Read every dense tensor, check its shape against ``cfg``, move it to ``device`` as ``dtype``."""
    if cfg.arch == "qwen3_next":
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
        return next_dense_state_dict(cfg, weights)
    state = {EMBED: weights.embed, FINAL_NORM: weights.final_norm}
    if not cfg.tie_word_embeddings:
        state[LM_HEAD] = weights.lm_head
    for i, layer in enumerate(weights.layers):
        for field_name, (name, _) in dense_layer_names(cfg, i).items():
            state[name] = getattr(layer, field_name)
    return state
