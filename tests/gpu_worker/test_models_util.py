"""Helpers for the model and engine tests: tiny random transformers models of each architecture,
saved as checkpoints in the hub's per-expert layout (or transformers' fused one). No hub access."""
from __future__ import annotations

from pathlib import Path

import torch

# arch -> (transformers config class name, model class name, arch-specific config fields)
HF_ARCHS = {
    "qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
              dict(num_experts=8, moe_intermediate_size=32, intermediate_size=64, head_dim=16,
                   norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, intermediate_size=32, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, intermediate_size=32, head_dim=16)),
}
VOCAB = 128


def hf_model(arch: str, seed: int = 0, **overrides):
    """A float32 transformers model: hidden 64, 2 layers, 8 experts, top-2, with every weight
    re-drawn (norm weights too, so a swapped or skipped norm changes the output)."""
    import transformers
    cfg_name, model_name, arch_kw = HF_ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=4096,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)
    kw.update(arch_kw)
    kw.update(overrides)
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)        # U(0.5, 1.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf(model, path: Path, fmt: str = "hub", max_shard_size: str | None = None) -> Path:
    """save_pretrained in the hub's per-expert layout (transformers' default) or the fused one."""
    kwargs = {"save_original_format": fmt == "hub"}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **kwargs)
    return path


def prompt_ids(n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation with its KV cache."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
