"""`make_model`: the forward class of a config's architecture (`MoeModel`, or `Qwen3NextModel` for qwen3_next)."""
from __future__ import annotations

from .config import MoeConfig
from .dense_weights import DenseWeights
from .expert_backend import ExpertBackend
from .model import MoeModel
from .qwen3_next import Qwen3NextModel


def make_model(cfg: MoeConfig, dense: DenseWeights, experts: ExpertBackend, max_positions: int,
               fused_kernels: bool | None = None) -> MoeModel | Qwen3NextModel:
    cls = Qwen3NextModel if cfg.arch == "qwen3_next" else MoeModel
    return cls(cfg, dense, experts, max_positions=max_positions, fused_kernels=fused_kernels)
