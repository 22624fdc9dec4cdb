"""The pieces of config.json parsing that `MoeConfig` (config.py) and the per-architecture modules
(gpt_oss_config.py, qwen3_next_config.py) share: the dtype names, qwen3_next's layer kinds and its linear
layers' shape, and `first_of` (a field under one of several names). It imports none of them, so that
config.py can import the per-architecture modules and they import only this one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"   # qwen3_next's layer_types

DTYPE_NAMES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "yarn")
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate",
             "attention_factor")


def parse_rope(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json's `rope_parameters` (or the older `rope_scaling`) -> {} for the default RoPE, or YaRN's
    parameters with rope_type "yarn" (computed by gpu_worker/models/layers.py: yarn_inv_freq). Another type, or a
    YaRN field that is not computed (DeepSeek's mscale), is refused, naming the file."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)}); "
                         f"remove rope_scaling or use a checkpoint without it")
    if rope_type == "default":
        return {}
    if rope.get("original_max_position_embeddings") is None:
        raise ValueError(f"{source}: rope_parameters (yarn) lacks original_max_position_embeddings, the context the "
                         f"model was trained at (32768 for Qwen3)")
    unknown = sorted(set(rope) - set(YARN_KEYS) - {"rope_type", "type", "rope_theta", "mscale", "mscale_all_dim",
                                                  "partial_rotary_factor"})
    if unknown or rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError(f"{source}: rope_parameters fields {unknown or ['mscale']} are not supported for YaRN "
                         f"(known: {', '.join(YARN_KEYS)})")
    return {"rope_type": "yarn", **{k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}}


def first_of(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first of `keys` that `raw` holds (not None), else `default`."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


@dataclass(frozen=True)
class LinearAttentionShape:
    """qwen3_next's Gated DeltaNet layers: key/value heads and head sizes, the short convolution's width."""
    num_key_heads: int              # Hk
    num_value_heads: int            # Hv (a multiple of Hk)
    key_head_dim: int               # Dk
    value_head_dim: int             # Dv
    conv_kernel_dim: int            # the causal depthwise conv1d's kernel (4)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:      # channels of the conv: q, k and v
        return 2 * self.key_dim + self.value_dim
