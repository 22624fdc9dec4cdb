"""gpt-oss (``GptOssForCausalLM``) config.json <-> `MoeConfig`.

What gpt-oss has that the other architectures lack lives in ``MoeConfig.extra["gpt_oss"]`` (a plain dict, so
``MoeConfig.replace`` keeps it) and is read back as a typed `GptOssParams` by ``gpt_oss_params(cfg)``:

- ``layer_types``: per layer "sliding_attention" (a causal window of ``window`` keys) or "full_attention";
- ``window``: the sliding window (128 in the published models); ``MoeConfig.sliding_window`` stays None, since
  that field means "every layer", and gpt-oss's window applies to its sliding layers only;
- ``rope``: YaRN (``rope_type: yarn``, factor, beta_fast, beta_slow, original_max_position_embeddings, truncate)
  or the default RoPE;
- ``swiglu_alpha`` / ``swiglu_limit``: the experts' clamped SwiGLU (1.702 / 7.0);
- ``attention_bias``: q/k/v/o projections with biases (true in the published models).

Anything else it cannot compute is refused, naming the file and the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftexpert.proto.expert_act import SILU, gpt_oss_act

from ftexpert.gpu_worker.checkpoint.config_fields import DTYPE_NAMES, first_of, parse_rope
from ftexpert.gpu_worker.checkpoint.quant_config import checkpoint_expert_format

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssParams:
    layer_types: tuple[str, ...]
    window: int | None
    rope: dict[str, Any]
    swiglu_alpha: float
    swiglu_limit: float
    attention_bias: bool

    def layer_window(self, layer: int) -> int | None:
        """The causal window of ``layer``'s attention (None: full attention)."""
        return self.window if self.layer_types[layer] == "sliding_attention" else None


def gpt_oss_params(cfg) -> GptOssParams:
    raw = cfg.extra.get("gpt_oss")
    if cfg.arch != "gptoss" or raw is None:
        raise ValueError(f"{cfg.hf_architecture} has no gpt-oss parameters")
    return GptOssParams(layer_types=tuple(raw["layer_types"]), window=raw["window"], rope=dict(raw["rope"]),
                        swiglu_alpha=float(raw["swiglu_alpha"]), swiglu_limit=float(raw["swiglu_limit"]),
                        attention_bias=bool(raw["attention_bias"]))


def _check(source: str, raw: dict[str, Any], layers: int) -> tuple[list[str], int | None, dict[str, Any]]:
    types = raw.get("layer_types")
    if types is None:       # transformers' default: sliding, full, sliding, ...
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    types = list(types)
    if len(types) != layers:
        raise ValueError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"{source}: layer_types {bad} are not supported (gpt-oss layers are "
                         f"{' or '.join(LAYER_TYPES)})")
    window = raw.get("sliding_window")
    if "sliding_attention" in types:
        if window is None or int(window) < 1:
            raise ValueError(f"{source}: sliding_window={window!r}: layer_types has sliding_attention layers, "
                             f"which need a window of at least 1 key")
        window = int(window)
    else:
        window = None
    rope = parse_rope(raw, source) or {"rope_type": "default"}
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported (gpt-oss's experts use their "
                         f"clamped SwiGLU)")
    return types, window, rope


def gpt_oss_config(cls, raw: dict[str, Any], source: str):
    """The `MoeConfig` of a gpt-oss config.json (``cls``: MoeConfig)."""
    layers = int(raw["num_hidden_layers"])
    types, window, rope = _check(source, raw, layers)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    theta = float(first_of(raw.get("rope_parameters") or {}, "rope_theta",
                         default=first_of(raw, "rope_theta", default=150000.0)))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    dtype = str(first_of(raw, "dtype", "torch_dtype", default="bfloat16")).replace("torch.", "")
    quant = raw.get("quantization_config") or {}
    fmt = checkpoint_expert_format(quant, source)
    params = {"layer_types": types, "window": window, "rope": rope,
              "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
              "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
              "attention_bias": bool(raw.get("attention_bias", True))}
    return cls(
        arch="gptoss", vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=int(first_of(raw, "num_key_value_heads", default=heads)),
        head_dim=int(first_of(raw, "head_dim", default=hidden // heads)),
        num_experts=int(first_of(raw, "num_local_experts", "num_experts")), top_k=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(first_of(raw, "rms_norm_eps", default=1e-5)), rope_theta=theta,
        rope_scaling=rope if rope["rope_type"] == "yarn" else {},
        max_position_embeddings=int(first_of(raw, "max_position_embeddings", default=131072)),
        norm_topk_prob=True, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=None, dtype=dtype if dtype in DTYPE_NAMES else "bfloat16",
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids, pad_token_id=raw.get("pad_token_id"),
        expert_format=fmt.label,
        extra={"gpt_oss": params, **{k: raw[k] for k in ("initializer_range",) if k in raw}},
        quantization=dict(quant) if isinstance(quant, dict) else {})


def gpt_oss_hf_dict(cfg) -> dict[str, Any]:
    """The config.json of a gpt-oss `MoeConfig` (transformers' GptOssConfig reads it)."""
    p = gpt_oss_params(cfg)
    raw: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "intermediate_size": cfg.expert_intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {**p.rope, "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": p.attention_bias, "attention_dropout": 0.0,
        "layer_types": list(p.layer_types), "sliding_window": p.window, "swiglu_alpha": p.swiglu_alpha,
        "swiglu_limit": p.swiglu_limit, "torch_dtype": cfg.dtype, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                         else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)),
        "pad_token_id": cfg.pad_token_id, "initializer_range": cfg.extra.get("initializer_range", 0.02),
    }
    if cfg.quantization:
        raw["quantization_config"] = dict(cfg.quantization)
    return raw


def expert_act_of(cfg):
    """The experts' activation of ``cfg`` (proto/expert_act.py): gpt-oss's clamped SwiGLU with biases, else silu."""
    if cfg.arch != "gptoss":
        return SILU
    p = gpt_oss_params(cfg)
    return gpt_oss_act(p.swiglu_alpha, p.swiglu_limit)
