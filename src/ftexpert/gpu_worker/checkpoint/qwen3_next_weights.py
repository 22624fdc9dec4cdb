"""Qwen3-Next's dense (non-routed-expert) weights: names as the checkpoints store them, loading, seeded random
weights, and the state dict for writing a checkpoint.

Every layer has the input / post-attention norms, the router and the shared expert with its gate; a
``linear_attention`` layer has the Gated DeltaNet projections, conv1d, ``A_log``, ``dt_bias`` and gated norm; a
``full_attention`` layer has q (with its output gate: 2 x Hq x D rows), k, v, o and the per-head q/k norms. The
RMSNorms other than the gated one store ``w`` of ``(1 + w) * x``, so a fresh model's are zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.gpu_worker.checkpoint.reader import CheckpointError, CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION, MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_tensors import DenseWeights, fuse_rows
from ftexpert.gpu_worker.checkpoint.expert_sources import seeded_generator
from ftexpert.gpu_worker.checkpoint.weight_names import EMBED, FINAL_NORM, LM_HEAD


@dataclass
class NextLayerWeights:
    attn_norm: torch.Tensor                    # [H] (1 + w)
    mlp_norm: torch.Tensor                     # [H] (1 + w)
    router: torch.Tensor                       # [E, H]
    shared_gate_proj: torch.Tensor             # [Is, H]
    shared_up_proj: torch.Tensor               # [Is, H]
    shared_down_proj: torch.Tensor             # [H, Is]
    shared_expert_gate: torch.Tensor           # [1, H]
    # linear_attention layers
    in_proj_qkvz: torch.Tensor | None = None   # [2*Hk*Dk + 2*Hv*Dv, H], grouped per key head
    in_proj_ba: torch.Tensor | None = None     # [2*Hv, H], grouped per key head
    conv1d: torch.Tensor | None = None         # [conv_dim, K] (the checkpoint's [conv_dim, 1, K])
    dt_bias: torch.Tensor | None = None        # [Hv]
    A_log: torch.Tensor | None = None          # [Hv]
    linear_norm: torch.Tensor | None = None    # [Dv] (plain w: RMSNormGated)
    out_proj: torch.Tensor | None = None       # [H, Hv*Dv]
    # full_attention layers
    q_proj: torch.Tensor | None = None         # [2*Hq*D, H]: per head, D query rows then D gate rows
    k_proj: torch.Tensor | None = None         # [Hkv*D, H]
    v_proj: torch.Tensor | None = None         # [Hkv*D, H]
    o_proj: torch.Tensor | None = None         # [H, Hq*D]
    q_norm: torch.Tensor | None = None         # [D] (1 + w)
    k_norm: torch.Tensor | None = None         # [D] (1 + w)
    router_bias: None = None                   # Qwen3-Next's router has no bias (the field every layer kind has)
    # fuse_next_projections: the projections that read the same input as one weight each (the fields above become
    # row views of these; None until fused)
    moe_in_proj: torch.Tensor | None = None    # [E + 2*Is, H]: router, shared gate, shared up
    in_proj_all: torch.Tensor | None = None    # linear_attention: [rows of in_proj_qkvz + in_proj_ba, H]
    qkv_proj: torch.Tensor | None = None       # full_attention: [2*Hq*D + 2*Hkv*D, H]: q (with its gate), k, v


# the groups of projections that read one input, fused by fuse_next_projections: fused field -> its parts in order
FUSED_PROJECTIONS = {
    "moe_in_proj": ("router", "shared_gate_proj", "shared_up_proj"),
    "in_proj_all": ("in_proj_qkvz", "in_proj_ba"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
}


def fuse_next_projections(weights: DenseWeights) -> None:
    """Concatenate each layer's projections that read the same input (`FUSED_PROJECTIONS`: the MoE's router with the
    shared expert's gate and up; a linear-attention layer's in_proj_qkvz with in_proj_ba; a full-attention layer's q,
    k and v) into one weight whose row views the parts become (dense_tensors.fuse_rows), so a decode step runs one
    GEMV where it ran two or three. Each output row is the same dot product as before (the decode GEMV's blocks
    depend on K only), so values are unchanged; checkpoints and state dicts read the views. Idempotent; one group at
    a time (peak extra memory: one group's weights)."""
    for layer in weights.layers:
        for fused, parts in FUSED_PROJECTIONS.items():
            fuse_rows(layer, fused, parts)


# fields that hold fp32 values whatever the model dtype (the decay's parameters)
FP32_FIELDS = ("A_log", "dt_bias")


def layer_names(cfg: MoeConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """field -> (tensor name, stored shape) for one qwen3_next layer."""
    p = f"model.layers.{layer}."
    H, E, Is = cfg.hidden_size, cfg.num_experts, cfg.shared_expert_intermediate_size
    names = {
        "attn_norm": (p + "input_layernorm.weight", (H,)),
        "mlp_norm": (p + "post_attention_layernorm.weight", (H,)),
        "router": (p + "mlp.gate.weight", (E, H)),
        "shared_gate_proj": (p + "mlp.shared_expert.gate_proj.weight", (Is, H)),
        "shared_up_proj": (p + "mlp.shared_expert.up_proj.weight", (Is, H)),
        "shared_down_proj": (p + "mlp.shared_expert.down_proj.weight", (H, Is)),
        "shared_expert_gate": (p + "mlp.shared_expert_gate.weight", (1, H)),
    }
    if cfg.layer_types[layer] == LINEAR_ATTENTION:
        lin, a = cfg.linear_attention, p + "linear_attn."
        names.update({
            "in_proj_qkvz": (a + "in_proj_qkvz.weight", (2 * lin.key_dim + 2 * lin.value_dim, H)),
            "in_proj_ba": (a + "in_proj_ba.weight", (2 * lin.num_value_heads, H)),
            "conv1d": (a + "conv1d.weight", (lin.conv_dim, 1, lin.conv_kernel_dim)),
            "dt_bias": (a + "dt_bias", (lin.num_value_heads,)),
            "A_log": (a + "A_log", (lin.num_value_heads,)),
            "linear_norm": (a + "norm.weight", (lin.value_head_dim,)),
            "out_proj": (a + "out_proj.weight", (H, lin.value_dim)),
        })
    else:
        a, D = p + "self_attn.", cfg.head_dim
        names.update({
            "q_proj": (a + "q_proj.weight", (2 * cfg.q_size, H)),
            "k_proj": (a + "k_proj.weight", (cfg.kv_size, H)),
            "v_proj": (a + "v_proj.weight", (cfg.kv_size, H)),
            "o_proj": (a + "o_proj.weight", (H, cfg.q_size)),
            "q_norm": (a + "q_norm.weight", (D,)),
            "k_norm": (a + "k_norm.weight", (D,)),
        })
    return names


def _field_dtype(field_name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if field_name in FP32_FIELDS else dtype


def _to_field(field_name: str, t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[-1]) if field_name == "conv1d" else t


def load_next_dense(reader: CheckpointReader, cfg: MoeConfig, device: torch.device | str,
                    dtype: torch.dtype) -> DenseWeights:
    """Read every qwen3_next dense tensor, checked against ``cfg``; a missing one is named with its layer type."""
    layers = []
    for i in range(cfg.num_layers):
        values = {}
        for field_name, (name, shape) in layer_names(cfg, i).items():
            if not reader.has(name):
                raise CheckpointError(
                    f"{reader.model_dir}: tensor {name!r} is missing; layer {i} is a {cfg.layer_types[i]} layer "
                    f"(config.json layer_types) and needs it. The checkpoint is incomplete, or layer_types / "
                    f"full_attention_interval in config.json does not match the weights")
            t = reader.get(name, shape).to(device=device, dtype=_field_dtype(field_name, dtype))
            values[field_name] = _to_field(field_name, t)
        layers.append(NextLayerWeights(**values))
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = reader.get(EMBED, (V, H)).to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings and not reader.has(LM_HEAD):
        lm_head = embed
    else:
        lm_head = reader.get(LM_HEAD, (V, H)).to(device=device, dtype=dtype)
    final_norm = reader.get(FINAL_NORM, (H,)).to(device=device, dtype=dtype)
    return DenseWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def random_next_dense(cfg: MoeConfig, device: torch.device | str, dtype: torch.dtype, seed: int,
                      std: float = 0.02) -> DenseWeights:
    """Seeded random dense weights as transformers initialises them: normal(0, std) matrices, (1 + w) norms at
    zero, the gated norm at one, ``dt_bias`` one, ``A_log`` = log U(1, 16) (a decay that forgets within a few
    hundred tokens); each tensor from its own generator keyed by (seed, layer, field)."""
    layers = []
    for i in range(cfg.num_layers):
        values = {}
        for k, (field_name, (_, shape)) in enumerate(sorted(layer_names(cfg, i).items())):
            gen = seeded_generator(device, seed, 2, i, k)
            fdtype = _field_dtype(field_name, dtype)
            if field_name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
                t = torch.zeros(shape, device=device, dtype=fdtype)
            elif field_name in ("linear_norm", "dt_bias"):
                t = torch.ones(shape, device=device, dtype=fdtype)
            elif field_name == "A_log":
                t = torch.empty(shape, device=device, dtype=fdtype).uniform_(1.0, 16.0, generator=gen).log_()
            else:
                t = torch.empty(shape, device=device, dtype=fdtype).normal_(0.0, std, generator=gen)
            values[field_name] = _to_field(field_name, t)
        layers.append(NextLayerWeights(**values))
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = torch.empty((V, H), device=device, dtype=dtype).normal_(0.0, std, generator=seeded_generator(
        device, seed, 3, 0))
    lm_head = embed if cfg.tie_word_embeddings else torch.empty((V, H), device=device, dtype=dtype).normal_(
        0.0, std, generator=seeded_generator(device, seed, 3, 1))
    return DenseWeights(embed=embed, layers=layers, final_norm=torch.zeros((H,), device=device, dtype=dtype),
                        lm_head=lm_head)


def next_dense_state_dict(cfg: MoeConfig, weights: DenseWeights) -> dict[str, torch.Tensor]:
    """Hub tensor names -> tensors (for writing a checkpoint)."""
    state = {EMBED: weights.embed, FINAL_NORM: weights.final_norm}
    if not cfg.tie_word_embeddings:
        state[LM_HEAD] = weights.lm_head
    for i, layer in enumerate(weights.layers):
        for field_name, (name, shape) in layer_names(cfg, i).items():
            state[name] = getattr(layer, field_name).reshape(shape)
    return state


def is_full_attention(cfg: MoeConfig, layer: int) -> bool:
    return cfg.layer_types[layer] == FULL_ATTENTION
