"""The pieces of config.json parsing that `MoeConfig` (config.py) and the per-architecture modules
(gpt_oss_config.py, qwen3_next_config.py) share: the dtype names, qwen3_next's layer kinds and its linear
layers' shape, and `first_of` (a field under one of several names). It imports none of them, so that
config.py can import the per-architecture modules and they import only this one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"   # qwen3_next's layer_types

DTYPE_NAMES = ("float32", "bfloat16", "float16")


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
