"""MoE models: config, checkpoint reading, dense weights, the expert seam, presets, the forward."""
from .config import MoeConfig
from .expert_backends import BackendNotAvailableError, make_expert_backend
from .expert_layout import ExpertLayout, pack_experts, unpack_experts
from .expert_sources import CheckpointExpertSource, ExpertSource, RandomExpertSource
from .loader import LoadedModel, ModelSource, load_model, open_model_source
from .model import AttentionContext, MoeModel
from .presets import PRESET_NAMES
from .expert_backend import ExpertBackend
from .resident_experts import ResidentExperts

__all__ = [
    "MoeConfig", "BackendNotAvailableError", "make_expert_backend", "ExpertLayout", "pack_experts",
    "unpack_experts", "CheckpointExpertSource", "ExpertSource", "RandomExpertSource", "LoadedModel",
    "ModelSource", "load_model", "open_model_source", "AttentionContext", "MoeModel", "PRESET_NAMES",
    "ExpertBackend", "ResidentExperts",
]
