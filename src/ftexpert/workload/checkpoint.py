"""A trained ``MoeLM`` as a Hugging Face ``Qwen3MoeForCausalLM`` checkpoint, and back.

The directory holds config.json, model.safetensors (experts in the hub's per-expert layout, which
transformers and this service's loader both read), the tokenizer files with a chat template, and
``ft_workload.json`` (shape, seed, training tokens and corpus: how it was made). It appears
atomically: written to a temporary sibling, then renamed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ftexpert.workload.model import ModelConfig, MoeLM
from ftexpert.workload.tokenizer import PAD, eos_ids, tokenizer_files

WEIGHTS = "model.safetensors"
META = "ft_workload.json"


def hf_config(cfg: ModelConfig, tok: Tokenizer, dtype: str) -> dict:
    eos = eos_ids(tok)
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_intermediate_size * cfg.top_k,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "initializer_range": cfg.initializer_range,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": eos,
        "pad_token_id": tok.token_to_id(PAD),
    }


def config_from_hf(raw: dict) -> ModelConfig:
    if raw.get("architectures") != ["Qwen3MoeForCausalLM"]:
        raise ValueError(f"architectures={raw.get('architectures')!r}: only Qwen3MoeForCausalLM "
                         f"checkpoints are read here")
    rope = raw.get("rope_parameters") or {}
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"], num_experts=raw["num_experts"], top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=raw["norm_topk_prob"],
        rms_norm_eps=raw["rms_norm_eps"], rope_theta=rope.get("rope_theta", raw.get("rope_theta")),
        max_position_embeddings=raw["max_position_embeddings"],
        router_aux_loss_coef=raw.get("router_aux_loss_coef", 0.001),
        initializer_range=raw.get("initializer_range", 0.02))


def hf_state_dict(model: MoeLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint names -> tensors (contiguous copies: safetensors refuses shared memory)."""
    inter = model.cfg.moe_intermediate_size
    state = {}
    for name, p in model.state_dict().items():
        p = p.detach().to("cpu", dtype)
        if name.startswith("lm_head."):
            state[name] = p.clone()
            continue
        if name.endswith("mlp.gate_up_proj") or name.endswith("mlp.down_proj"):
            prefix = "model." + name.rsplit(".", 1)[0] + ".experts"
            for e in range(p.shape[0]):
                if name.endswith("gate_up_proj"):
                    state[f"{prefix}.{e}.gate_proj.weight"] = p[e, :inter].clone()
                    state[f"{prefix}.{e}.up_proj.weight"] = p[e, inter:].clone()
                else:
                    state[f"{prefix}.{e}.down_proj.weight"] = p[e].clone()
            continue
        state["model." + name] = p.clone()
    return state


def write_checkpoint(out_dir: str | Path, model: MoeLM, tok: Tokenizer, dtype: str,
                     meta: dict) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new --out directory")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(hf_state_dict(model, getattr(torch, dtype)), str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(model.cfg, tok, dtype), indent=2))
    for name, text in tokenizer_files(tok, model.cfg.max_position_embeddings).items():
        (tmp / name).write_text(text)
    (tmp / META).write_text(json.dumps(meta, indent=2))
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir


def load_checkpoint(model_dir: str | Path, device: str = "cpu",
                    experts_impl: str | None = None) -> tuple[MoeLM, Tokenizer]:
    """A checkpoint written by ``write_checkpoint`` (or any single-file Qwen3-MoE one), in float32."""
    model_dir = Path(model_dir)
    for need in ("config.json", WEIGHTS, "tokenizer.json"):
        if not (model_dir / need).is_file():
            raise FileNotFoundError(f"{model_dir / need} not found: --model must be a directory "
                                    f"written by train_moe (config.json, {WEIGHTS}, tokenizer.json)")
    cfg = config_from_hf(json.loads((model_dir / "config.json").read_text()))
    hub = load_file(str(model_dir / WEIGHTS))
    state = {}
    for i in range(cfg.num_layers):
        base = f"model.layers.{i}.mlp.experts"
        gate_up = [torch.cat([hub.pop(f"{base}.{e}.gate_proj.weight"), hub.pop(f"{base}.{e}.up_proj.weight")])
                   for e in range(cfg.num_experts)]
        state[f"layers.{i}.mlp.gate_up_proj"] = torch.stack(gate_up)
        state[f"layers.{i}.mlp.down_proj"] = torch.stack(
            [hub.pop(f"{base}.{e}.down_proj.weight") for e in range(cfg.num_experts)])
    for name, tensor in hub.items():
        state[name.removeprefix("model.")] = tensor
    model = MoeLM(cfg, experts_impl)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.to(device).eval(), Tokenizer.from_file(str(model_dir / "tokenizer.json"))
