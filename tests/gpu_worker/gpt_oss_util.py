"""Tiny random gpt-oss checkpoints made by transformers (no hub access): unquantized as transformers saves them,
and MXFP4 in the hub's layout (``gate_up_proj_blocks`` / ``_scales`` with gate and up rows interleaved)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ftexpert.proto.expert_format import ExpertFormat
from ftexpert.kernels.expert_reference import dequantize_matrix, quantize_matrix

VOCAB = 128
WINDOW = 8          # the tiny sliding window: prompts of 11 and 23 tokens run past it


def hf_gpt_oss(seed: int = 0, scale: float = 0.3, **overrides):
    """A float32 GptOssForCausalLM: hidden 64, 3 layers (sliding, full, sliding), 8 experts top-4, I 32, every
    weight re-drawn (norms U(0.5, 1.5); the rest N(0, scale), large enough that the SwiGLU clamp at 7 bites)."""
    import transformers
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4,
              sliding_window=WINDOW, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    kw.update(overrides)
    config = transformers.GptOssConfig(**kw)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [rows, K] (the [out, in] order) -> (blocks [rows, K/32, 16] uint8, scales [rows, K/32] uint8, the
    dequantized w [rows, K] float32)."""
    fmt = ExpertFormat.parse("mxfp4")
    rows, k = w.shape
    q = quantize_matrix(w.float(), fmt)
    return (q.codes.reshape(rows, k // 32, 16).contiguous(), q.scales.reshape(rows, k // 32).contiguous(),
            dequantize_matrix(q, fmt, rows, k))


def save_mxfp4(model, path: Path) -> Path:
    """Save ``model`` with its experts as the hub stores gpt-oss (MXFP4 blocks and scales, quantization_config
    mxfp4), and set ``model``'s experts to the dequantized weights (transformers then computes what the checkpoint
    holds)."""
    from safetensors.torch import save_file
    model.save_pretrained(str(path))
    state = {}
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            state[name] = f.get_tensor(name)
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        p = f"model.layers.{i}.mlp.experts."
        gu_blocks, gu_scales, gu_deq, d_blocks, d_scales, d_deq = [], [], [], [], [], []
        for e in range(ex.num_experts):
            b, s, dq = mxfp4_blocks(ex.gate_up_proj.data[e].t())          # [2I, H], rows interleaved
            gu_blocks.append(b), gu_scales.append(s), gu_deq.append(dq.t())
            b, s, dq = mxfp4_blocks(ex.down_proj.data[e].t())             # [H, I]
            d_blocks.append(b), d_scales.append(s), d_deq.append(dq.t())
        del state[p + "gate_up_proj"], state[p + "down_proj"]
        state[p + "gate_up_proj_blocks"] = torch.stack(gu_blocks)
        state[p + "gate_up_proj_scales"] = torch.stack(gu_scales)
        state[p + "down_proj_blocks"] = torch.stack(d_blocks)
        state[p + "down_proj_scales"] = torch.stack(d_scales)
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.stack(gu_deq))
            ex.down_proj.copy_(torch.stack(d_deq))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path
