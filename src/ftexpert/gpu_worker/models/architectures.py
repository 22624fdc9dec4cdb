"""`make_model`: the forward class of a config's architecture (`MoeModel`; `Qwen3NextModel` for qwen3_next,
`GptOssModel` for gptoss)."""
from __future__ import annotations

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_tensors import DenseWeights
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.models.gpt_oss import GptOssModel
from ftexpert.gpu_worker.models.model import MoeModel
from ftexpert.gpu_worker.models.qwen3_next import Qwen3NextModel

MODEL_CLASSES: dict[str, type] = {"qwen3_next": Qwen3NextModel, "gptoss": GptOssModel}   # others: MoeModel


def make_model(cfg: MoeConfig, dense: DenseWeights, experts: ExpertBackend, max_positions: int,
               fused_kernels: bool | None = None) -> MoeModel | Qwen3NextModel:
    cls = MODEL_CLASSES.get(cfg.arch, MoeModel)
    return cls(cfg, dense, experts, max_positions=max_positions, fused_kernels=fused_kernels)
