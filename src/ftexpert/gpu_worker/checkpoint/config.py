"""`MoeConfig`: the one typed description of a supported MoE checkpoint.

Read from a Hugging Face ``config.json`` (``from_hf_dict``) and written back (``to_hf_dict``) so that a
synthesised checkpoint loads in transformers too. Three architectures share one decoder shape and
differ only in the details named here:

| arch     | router                          | q/k norm                      | expert keys            |
|----------|---------------------------------|-------------------------------|------------------------|
| qwen3    | softmax, top-k, norm_topk_prob  | RMSNorm per head (head_dim)   | mlp.experts.j.gate_proj |
| olmoe    | softmax, top-k, norm_topk_prob  | RMSNorm over the whole q / k  | mlp.experts.j.gate_proj |
| mixtral  | top-k logits, softmax           | none                          | block_sparse_moe.experts.j.w1 |
| gptoss   | top-k biased logits, softmax    | none (biases, sinks, windows) | mlp.experts.gate_up_proj      |

gpt-oss's own fields (``gptoss``; gpu_worker/checkpoint/gpt_oss_config.py reads and writes them) are in ``extra``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftexpert.proto.expert_format import ExpertFormat

# LINEAR_ATTENTION, FULL_ATTENTION and LinearAttentionShape are imported from here too (re-exported)
from ftexpert.gpu_worker.checkpoint.config_fields import (DTYPE_NAMES, FULL_ATTENTION, LINEAR_ATTENTION,
                                                          LinearAttentionShape, first_of, parse_rope)
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import gpt_oss_config, gpt_oss_hf_dict
from ftexpert.gpu_worker.checkpoint.quant_config import checkpoint_expert_format
from ftexpert.gpu_worker.checkpoint.qwen3_next_config import (check_qwen3_next, qwen3_next_fields_from_hf,
                                                              qwen3_next_hf_fields)

# HF architecture name -> our short name.
ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3",
    "OlmoeForCausalLM": "olmoe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3NextForCausalLM": "qwen3_next",      # Gated DeltaNet + gated attention hybrid (qwen3_next.py)
    "GptOssForCausalLM": "gptoss",
}
HF_ARCH_OF = {v: k for k, v in ARCHITECTURES.items()}
HF_MODEL_TYPE_OF = {"qwen3": "qwen3_moe", "olmoe": "olmoe", "mixtral": "mixtral", "qwen3_next": "qwen3_next",
                    "gptoss": "gpt_oss"}
@dataclass(frozen=True)
class MoeConfig:
    arch: str                       # "qwen3" | "olmoe" | "mixtral" | "gptoss"
    vocab_size: int
    hidden_size: int                # H
    num_layers: int                 # L
    num_heads: int                  # Hq
    num_kv_heads: int               # Hkv
    head_dim: int                   # D
    num_experts: int                # E
    top_k: int                      # K
    expert_intermediate_size: int   # I (one expert's FFN width)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    norm_topk_prob: bool = False    # qwen3 / olmoe: renormalise the top-k probabilities
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    clip_qkv: float | None = None   # olmoe only
    dtype: str = "bfloat16"         # checkpoint dtype name
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    expert_format: str = "bf16"     # the experts' format in the checkpoint (quantization_config; bf16: float)
    rope_scaling: dict[str, Any] = field(default_factory=dict)   # {}: the default RoPE; YaRN's parameters
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unparsed HF fields to keep
    quantization: dict[str, Any] = field(default_factory=dict, compare=False)  # the raw quantization_config
    # qwen3_next only: each layer's token mixer, the rotary share of head_dim, the shared expert's width and
    # the linear layers' shape (empty / 1.0 / 0 / None elsewhere: every layer is full attention)
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    linear_attention: LinearAttentionShape | None = None

    def __post_init__(self) -> None:
        if self.arch not in HF_ARCH_OF:
            raise ValueError(f"unknown arch {self.arch!r}; supported: {', '.join(HF_ARCH_OF)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
        object.__setattr__(self, "expert_format", ExpertFormat.parse(self.expert_format).label)
        if isinstance(self.linear_attention, dict):          # replace() passes asdict's dict
            object.__setattr__(self, "linear_attention", LinearAttentionShape(**self.linear_attention))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.arch == "qwen3_next":
            check_qwen3_next(self)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the KV cache (qwen3_next: its full-attention layers; elsewhere all)."""
        if not self.layer_types:
            return self.num_layers
        return sum(t == FULL_ATTENTION for t in self.layer_types)

    @property
    def context_length(self) -> int:
        """The longest context the model computes as trained: max_position_embeddings, or with YaRN the
        original context times its factor where that is longer (Qwen3: 32,768 x 4 = 131,072)."""
        rope = self.rope_scaling
        if rope.get("rope_type") == "yarn" and rope.get("factor") is not None:
            scaled = int(float(rope["factor"]) * int(rope["original_max_position_embeddings"]))
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def hf_architecture(self) -> str:
        return HF_ARCH_OF[self.arch]

    def replace(self, **changes: Any) -> "MoeConfig":
        values = asdict(self)
        values.update(changes)
        return MoeConfig(**values)

    # ---- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "MoeConfig":
        archs = raw.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ValueError(
                f"{source}: architectures={archs!r} is not supported; this service loads "
                f"{', '.join(ARCHITECTURES)} checkpoints")
        arch = ARCHITECTURES[known[0]]
        if arch == "gptoss":
            return gpt_oss_config(cls, raw, source)
        _reject_unsupported(arch, raw, source)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or {}
        if arch in ("qwen3", "qwen3_next"):
            experts = first_of(raw, "num_experts", "num_local_experts")
            inter = raw["moe_intermediate_size"]
        elif arch == "olmoe":
            experts = first_of(raw, "num_experts", "num_local_experts")
            inter = raw["intermediate_size"]
        else:
            experts = first_of(raw, "num_local_experts", "num_experts")
            inter = raw["intermediate_size"]
        window = raw.get("sliding_window")
        if arch == "qwen3" and not raw.get("use_sliding_window", False):
            window = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        dtype = str(first_of(raw, "dtype", "torch_dtype", default="bfloat16")).replace("torch.", "")
        quant = raw.get("quantization_config") or {}
        fmt = checkpoint_expert_format(quant, source)        # refuses a quantization it does not load
        return cls(
            arch=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(first_of(raw, "num_key_value_heads", default=heads)),
            head_dim=int(first_of(raw, "head_dim", default=hidden // heads)),
            num_experts=int(experts), top_k=int(raw["num_experts_per_tok"]),
            expert_intermediate_size=int(inter),
            rms_norm_eps=float(first_of(raw, "rms_norm_eps", default=1e-6)),
            rope_theta=float(first_of(rope, "rope_theta", default=first_of(raw, "rope_theta", default=10000.0))),
            rope_scaling=parse_rope(raw, source),
            max_position_embeddings=int(first_of(raw, "max_position_embeddings", default=32768)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", arch == "mixtral")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window is not None else None,
            clip_qkv=float(raw["clip_qkv"]) if raw.get("clip_qkv") is not None else None,
            dtype=dtype if dtype in DTYPE_NAMES else "bfloat16",
            bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"), expert_format=fmt.label,
            extra={k: raw[k] for k in ("intermediate_size", "initializer_range") if k in raw},
            quantization=dict(quant) if isinstance(quant, dict) else {},
            **(qwen3_next_fields(raw, source) if arch == "qwen3_next" else {}),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "MoeConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: --model must be a Hugging Face checkpoint directory holding "
                f"config.json and *.safetensors (or omit --model to use the tiny built-in model)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); re-download the checkpoint") from None
        return cls.from_hf_dict(raw, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers and ``from_hf_dict`` both read back to this config."""
        if self.arch == "gptoss":
            return gpt_oss_hf_dict(self)
        raw: dict[str, Any] = {
            "architectures": [self.hf_architecture], "model_type": HF_MODEL_TYPE_OF[self.arch],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "num_experts_per_tok": self.top_k, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default", **self.rope_scaling},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.extra.get("initializer_range", 0.02),
        }
        if self.quantization:
            raw["quantization_config"] = dict(self.quantization)
        if self.arch == "qwen3_next":
            raw.update(qwen3_next_hf_fields(self))
            return raw
        inter_dense = self.extra.get("intermediate_size", self.expert_intermediate_size)
        if self.arch == "qwen3":
            raw.update(num_experts=self.num_experts, moe_intermediate_size=self.expert_intermediate_size,
                       intermediate_size=inter_dense, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=[],
                       use_sliding_window=self.sliding_window is not None,
                       sliding_window=self.sliding_window)
        elif self.arch == "olmoe":
            raw.update(num_experts=self.num_experts, intermediate_size=self.expert_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, clip_qkv=self.clip_qkv)
        else:
            raw.update(num_local_experts=self.num_experts, intermediate_size=self.expert_intermediate_size,
                       sliding_window=self.sliding_window, router_jitter_noise=0.0)
        return raw


def qwen3_next_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return qwen3_next_fields_from_hf(raw, source)


def _reject_unsupported(arch: str, raw: dict[str, Any], source: str) -> None:
    """Raise for config features this implementation does not compute (never silently ignore)."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported (only silu)")
    if raw.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported")
    if arch in ("qwen3", "qwen3_next"):
        step = int(raw.get("decoder_sparse_step", 1))
        dense = raw.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ValueError(f"{source}: dense MLP layers (decoder_sparse_step={step}, "
                             f"mlp_only_layers={dense}) are not supported; every layer must be MoE")
