"""Model presets: real models' shapes (numbers from their published config.json) with seeded random
weights, for timing and memory work without downloading a checkpoint.

``random_model_parts(name, device, dtype, seed)`` generates the dense weights on ``device`` in bulk
(one tensor at a time, on the device's own generator) and returns a `RandomExpertSource` that
writes each layer's experts straight into its packed [E, N] home, so a 60 GB preset loads onto a
GPU without any host copy of the experts.
"""
from __future__ import annotations

import dataclasses

import torch

from ftexpert.gpu_worker.checkpoint.config import LinearAttentionShape, MoeConfig
from ftexpert.gpu_worker.checkpoint.qwen3_next_config import default_layer_types
from ftexpert.gpu_worker.checkpoint.dense_weights import DenseWeights, random_dense_weights
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout
from ftexpert.gpu_worker.checkpoint.expert_sources import RandomExpertSource
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import expert_act_of
from ftexpert.proto.engine_spec import DEFAULT_MODEL_DIR

# The embedded default model of `ft serve` / `ft generate` (neither --model nor --preset): a small MoE
# trained on the bundled corpus by `ft bench train-moe --shape default` (docs/WORKLOAD.md), shipped in
# the package. Library callers without a model get the tiny seeded-random model (`TINY`) instead.
# (its path is in proto/engine_spec.py, which the coordinator reads without torch; this is the same folder,
# data/default-moe beside this file)

TINY = "tiny"   # the embedded default (tiny.py): written to a cache dir with a tokenizer

PRESETS: dict[str, MoeConfig] = {
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": MoeConfig(
        arch="qwen3", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, expert_intermediate_size=768, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, norm_topk_prob=True,
        tie_word_embeddings=False, dtype="bfloat16", bos_token_id=151643, eos_token_ids=(151645,),
        extra={"intermediate_size": 6144, "initializer_range": 0.02}),
    # allenai/OLMoE-1B-7B-0924
    "olmoe-1b-7b": MoeConfig(
        arch="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16,
        head_dim=128, num_experts=64, top_k=8, expert_intermediate_size=1024, rms_norm_eps=1e-5,
        rope_theta=10_000.0, max_position_embeddings=4096, norm_topk_prob=False,
        tie_word_embeddings=False, dtype="bfloat16", bos_token_id=None, eos_token_ids=(50279,),
        pad_token_id=1, extra={"initializer_range": 0.02}),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": MoeConfig(
        arch="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336, rms_norm_eps=1e-5,
        rope_theta=1_000_000.0, max_position_embeddings=32768, norm_topk_prob=True,
        tie_word_embeddings=False, dtype="bfloat16", bos_token_id=1, eos_token_ids=(2,),
        extra={"initializer_range": 0.02}),
    # Qwen/Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults): 36 Gated DeltaNet + 12 gated attention
    # layers (3:1), 512 experts top-10 plus a shared expert
    "qwen3-next-80b-a3b": MoeConfig(
        arch="qwen3_next", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=16, num_kv_heads=2,
        head_dim=256, num_experts=512, top_k=10, expert_intermediate_size=512, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=32768, norm_topk_prob=True, tie_word_embeddings=False,
        dtype="bfloat16", bos_token_id=151643, eos_token_ids=(151645,),
        extra={"intermediate_size": 5632, "initializer_range": 0.02},
        layer_types=default_layer_types(48), partial_rotary_factor=0.25, shared_expert_intermediate_size=512,
        linear_attention=LinearAttentionShape(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                              value_head_dim=128, conv_kernel_dim=4)),
}


def _gpt_oss(layers: int, experts: int) -> MoeConfig:
    """openai/gpt-oss-20b and -120b's config.json: alternating sliding (128) and full attention, YaRN x32,
    attention sinks, biased experts with the clamped SwiGLU, served in MXFP4 (their hub format) by default."""
    return MoeConfig(
        arch="gptoss", vocab_size=201088, hidden_size=2880, num_layers=layers, num_heads=64, num_kv_heads=8,
        head_dim=64, num_experts=experts, top_k=4, expert_intermediate_size=2880, rms_norm_eps=1e-5,
        rope_theta=150000.0, max_position_embeddings=131072, norm_topk_prob=True, tie_word_embeddings=False,
        dtype="bfloat16", eos_token_ids=(199999, 200002, 200012), pad_token_id=199999, expert_format="mxfp4",
        extra={"initializer_range": 0.02, "gpt_oss": {
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "window": 128, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
            "rope": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False}}})


# Qwen/Qwen3-30B-A3B at 131,072 tokens: the YaRN scaling its model card gives for long contexts (config.json's
# rope_scaling {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
PRESETS["qwen3-30b-a3b-128k"] = dataclasses.replace(
    PRESETS["qwen3-30b-a3b"],
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
PRESETS["gpt-oss-20b"] = _gpt_oss(24, 32)       # openai/gpt-oss-20b
PRESETS["gpt-oss-120b"] = _gpt_oss(36, 128)     # openai/gpt-oss-120b

PRESET_NAMES = (TINY, *PRESETS)


def preset_config(name: str) -> MoeConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESET_NAMES)}")
    return PRESETS[name]


def random_model_parts(name_or_cfg: str | MoeConfig, device: torch.device | str, dtype: torch.dtype,
                       seed: int = 0) -> tuple[MoeConfig, DenseWeights, RandomExpertSource]:
    """(config, dense weights on ``device``, expert source) of a preset with seeded random weights."""
    cfg = preset_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    std = float(cfg.extra.get("initializer_range", 0.02))
    dense = random_dense_weights(cfg, device, dtype, seed, std=std)
    return cfg, dense, RandomExpertSource(cfg, dtype, seed, std=std)


def describe(cfg: MoeConfig) -> str:
    """One line: layers, experts, sizes, and the bytes the experts take."""
    layout = ExpertLayout(cfg.hidden_size, cfg.expert_intermediate_size, getattr(torch, cfg.dtype),
                          cfg.expert_format, expert_act_of(cfg))
    total_gib = cfg.num_layers * cfg.num_experts * layout.expert_nbytes / 2**30
    return (f"{cfg.hf_architecture}: {cfg.num_layers} layers, {cfg.num_experts} experts top-{cfg.top_k}, "
            f"hidden {cfg.hidden_size}, expert intermediate {cfg.expert_intermediate_size}, "
            f"{layout.expert_nbytes / 2**20:.2f} MiB an expert, {total_gib:.1f} GiB of experts "
            f"({cfg.expert_format if cfg.expert_format != 'bf16' else cfg.dtype})")
