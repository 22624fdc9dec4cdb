"""Qwen3-Next's config fields (``Qwen3NextForCausalLM``): read from and written to a Hugging Face config.json.

The model interleaves Gated DeltaNet (linear attention) layers with gated full attention: ``layer_types`` names
each layer's token mixer (``full_attention_interval`` = 4 gives three linear layers, then one full, as in the
released model). Every layer's FFN is the routed MoE plus one shared expert behind a sigmoid gate.

A ``cfg`` here is a `MoeConfig` (config.py), which imports this module: the type is not imported back.
"""
from __future__ import annotations

from typing import Any

from ftexpert.gpu_worker.checkpoint.config_fields import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionShape

LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """transformers' default: layer i is full attention when (i + 1) % interval == 0, else linear."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def qwen3_next_fields_from_hf(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The `MoeConfig` fields only qwen3_next has, from its config.json ``raw``."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        types = default_layer_types(layers, int(raw.get("full_attention_interval", 4)))
    rope = raw.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    try:
        linear = LinearAttentionShape(
            num_key_heads=int(raw["linear_num_key_heads"]), num_value_heads=int(raw["linear_num_value_heads"]),
            key_head_dim=int(raw["linear_key_head_dim"]), value_head_dim=int(raw["linear_value_head_dim"]),
            conv_kernel_dim=int(raw["linear_conv_kernel_dim"]))
    except KeyError as exc:
        raise ValueError(f"{source}: Qwen3NextForCausalLM needs {exc.args[0]!r} (the Gated DeltaNet layers' "
                         f"shape); the config.json is incomplete") from None
    return dict(layer_types=tuple(types), partial_rotary_factor=float(factor),
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
                linear_attention=linear)


def check_qwen3_next(cfg) -> None:
    """Raise for a qwen3_next config this implementation does not compute."""
    lin = cfg.linear_attention
    if lin is None:
        raise ValueError("qwen3_next needs linear_attention (the Gated DeltaNet layers' shape)")
    if len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(f"layer_types has {len(cfg.layer_types)} entries for num_hidden_layers={cfg.num_layers}")
    bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"layer_types {bad} are not supported; each layer is one of {', '.join(LAYER_TYPES)}")
    if lin.num_value_heads % lin.num_key_heads:
        raise ValueError(f"linear_num_value_heads={lin.num_value_heads} must be a multiple of "
                         f"linear_num_key_heads={lin.num_key_heads}")
    if lin.conv_kernel_dim < 2:
        raise ValueError(f"linear_conv_kernel_dim={lin.conv_kernel_dim} must be >= 2")
    rot = rotary_dim(cfg)
    if not 0 < rot <= cfg.head_dim or rot % 2:
        raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor} gives a rotary width of {rot} for "
                         f"head_dim={cfg.head_dim}; it must be even and in 2..head_dim")
    if cfg.shared_expert_intermediate_size < 1:
        raise ValueError("qwen3_next needs shared_expert_intermediate_size >= 1 (every layer has a shared expert)")
    if cfg.sliding_window is not None:
        raise ValueError("qwen3_next with a sliding window is not supported")


def rotary_dim(cfg) -> int:
    """The leading channels of each head that rotary embeddings rotate (the rest pass through)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def qwen3_next_hf_fields(cfg) -> dict[str, Any]:
    """The config.json fields of a qwen3_next `MoeConfig` beyond the common ones (transformers reads them back)."""
    lin = cfg.linear_attention
    return dict(
        num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_intermediate_size,
        intermediate_size=cfg.extra.get("intermediate_size", cfg.expert_intermediate_size),
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[], layer_types=list(cfg.layer_types),
        partial_rotary_factor=cfg.partial_rotary_factor,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default",
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        linear_num_key_heads=lin.num_key_heads, linear_num_value_heads=lin.num_value_heads,
        linear_key_head_dim=lin.key_head_dim, linear_value_head_dim=lin.value_head_dim,
        linear_conv_kernel_dim=lin.conv_kernel_dim)
