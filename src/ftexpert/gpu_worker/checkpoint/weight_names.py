"""Tensor names exactly as the checkpoints store them, and the shapes we expect.

Two expert layouts exist on disk:
- hub (per expert): what the Hugging Face hub holds and what transformers 5.x ``save_pretrained``
  writes by default (it converts its fused modules back):
  ``model.layers.{i}.mlp.experts.{j}.gate_proj.weight`` (qwen3, olmoe) or
  ``model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight`` (mixtral, w1 = gate, w3 = up, w2 = down).
- fused: transformers 5.x modules' own names, written by ``save_pretrained(save_original_format=False)``:
  ``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows then up rows) and
  ``model.layers.{i}.mlp.experts.down_proj`` [E, H, I]; mixtral's router is then ``mlp.gate.weight``.
"""
from __future__ import annotations

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import gpt_oss_params

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def _moe_prefix(cfg: MoeConfig, layer: int) -> str:
    return f"model.layers.{layer}." + ("block_sparse_moe" if cfg.arch == "mixtral" else "mlp")


def dense_layer_names(cfg: MoeConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """field -> (tensor name, expected shape) for one decoder layer's non-expert weights."""
    p = f"model.layers.{layer}."
    H, Q, KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
    names = {
        "attn_norm": (p + "input_layernorm.weight", (H,)),
        "q_proj": (p + "self_attn.q_proj.weight", (Q, H)),
        "k_proj": (p + "self_attn.k_proj.weight", (KV, H)),
        "v_proj": (p + "self_attn.v_proj.weight", (KV, H)),
        "o_proj": (p + "self_attn.o_proj.weight", (H, Q)),
        "mlp_norm": (p + "post_attention_layernorm.weight", (H,)),
        "router": (_moe_prefix(cfg, layer) + ".gate.weight", (cfg.num_experts, H)),
    }
    if cfg.arch == "gptoss":
        names["router"] = (p + "mlp.router.weight", (cfg.num_experts, H))
        names["router_bias"] = (p + "mlp.router.bias", (cfg.num_experts,))
        names["sinks"] = (p + "self_attn.sinks", (cfg.num_heads,))
        if gpt_oss_params(cfg).attention_bias:
            for proj, size in (("q", Q), ("k", KV), ("v", KV), ("o", H)):
                names[f"{proj}_bias"] = (p + f"self_attn.{proj}_proj.bias", (size,))
    if cfg.arch == "qwen3":
        names["q_norm"] = (p + "self_attn.q_norm.weight", (cfg.head_dim,))
        names["k_norm"] = (p + "self_attn.k_norm.weight", (cfg.head_dim,))
    elif cfg.arch == "olmoe":
        names["q_norm"] = (p + "self_attn.q_norm.weight", (Q,))
        names["k_norm"] = (p + "self_attn.k_norm.weight", (KV,))
    return names


def router_alt_name(cfg: MoeConfig, layer: int) -> str | None:
    """Mixtral's router under the fused layout's module name (``mlp.gate``), else None."""
    return f"model.layers.{layer}.mlp.gate.weight" if cfg.arch == "mixtral" else None


def expert_names(cfg: MoeConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one expert in the hub layout: [I, H], [I, H], [H, I]."""
    p = f"{_moe_prefix(cfg, layer)}.experts.{expert}."
    if cfg.arch == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def gpt_oss_expert_names(layer: int) -> tuple[str, str, str, str]:
    """gpt-oss's experts (transformers' layout, x @ W): gate_up_proj [E, H, 2I] (gate and up columns interleaved),
    its bias [E, 2I] (interleaved too), down_proj [E, I, H], its bias [E, H]."""
    p = f"model.layers.{layer}.mlp.experts."
    return p + "gate_up_proj", p + "gate_up_proj_bias", p + "down_proj", p + "down_proj_bias"


def fused_expert_names(layer: int) -> tuple[str, str]:
    """(gate_up [E, 2I, H], down [E, H, I]) names in transformers 5.x's fused layout."""
    p = f"model.layers.{layer}.mlp.experts."
    return p + "gate_up_proj", p + "down_proj"
