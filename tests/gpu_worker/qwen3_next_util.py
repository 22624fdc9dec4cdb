"""A tiny random transformers Qwen3-Next checkpoint for the tests (no hub access) and its reference generation."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128


def torch_reference_kernels() -> None:
    """Make transformers' Qwen3-Next run its own torch gated delta rule and convolutions: where fla-core (or
    causal-conv1d) is installed it swaps them for those packages' kernels, which are not the reference (and on a
    machine without a GPU do not run)."""
    import inspect

    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        setattr(hf, name, inspect.unwrap(getattr(hf, name)))


def hf_qwen3_next(seed: int = 0, **overrides):
    """A float32 Qwen3NextForCausalLM: hidden 64, 4 layers (3 Gated DeltaNet, then gated attention), 8 experts
    top-2 plus a shared expert, partial rotary 0.25 of head_dim 16, 2 key / 4 value linear heads; every weight
    re-drawn (the (1 + w) norms around zero, A_log and dt_bias so that the decay spans fast and slow heads)."""
    import transformers
    torch_reference_kernels()
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=4096,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):                          # plain w (RMSNormGated)
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "norm" in name:                                                  # (1 + w)
                p.copy_(torch.rand(p.shape, generator=gen) * 0.5 - 0.25)
            elif name.endswith("A_log"):
                p.copy_((torch.rand(p.shape, generator=gen) * 2).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save(model, path: Path) -> Path:
    model.save_pretrained(str(path))
    return path


def hf_greedy_full(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' full forward over the whole sequence at every step (no cache: its
    cached generation of Qwen3-Next does not reproduce its own full forward in transformers 5.24)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
