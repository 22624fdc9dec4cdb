"""Numerics against transformers itself: logits (float32, CPU, relative error <= 1e-4) and greedy
generations (identical tokens for 32 steps through the engine and its KV cache)."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.attention import PrefillAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.assembly.loader import load_model
from tests.built_engines import build, engine_of
from tests.gpu_worker.test_models_util import hf_greedy, hf_model, prompt_ids, rel_err, save_hf

# id -> (arch, transformers config overrides)
VARIANTS = {
    "qwen3": ("qwen3", {}),
    "olmoe": ("olmoe", {}),
    "mixtral": ("mixtral", {}),
    "olmoe-clip_qkv": ("olmoe", {"clip_qkv": 0.3}),
    "mixtral-sliding_window": ("mixtral", {"sliding_window": 8}),
    "qwen3-no_norm_topk-gqa4": ("qwen3", {"norm_topk_prob": False, "num_key_value_heads": 1}),
    "qwen3-head_dim32": ("qwen3", {"head_dim": 32}),        # Hq*D != H, as in Qwen3-30B-A3B
}
REL_TOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    hf = hf_model(arch, seed=7, **overrides)
    path = save_hf(hf, tmp_path_factory.mktemp(request.param))
    ours = build(path, dtype="float32", max_context_tokens=128)
    return hf, ours


def prefill_logits(loaded, prompt: list[int], chunk: int) -> torch.Tensor:
    """All-position logits [P, V] through the engine's prefill attention, ``chunk`` tokens at a time."""
    kv = KVCache(loaded.cfg, max_batch=2, max_context_tokens=256, dtype=torch.float32,
                 device=torch.device("cpu"))
    out = []
    for start in range(0, len(prompt), chunk):
        ids = prompt[start:start + chunk]
        attn = PrefillAttention(kv, slot=1, start_pos=start, num_tokens=len(ids),
                                sliding_window=loaded.cfg.sliding_window)
        out.append(loaded.model.forward(torch.tensor(ids), torch.arange(start, start + len(ids)), attn))
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [64, 5], ids=["one_chunk", "chunks_of_5"])
def test_logits_match_transformers(variant, chunk):
    hf, ours = variant
    prompt = prompt_ids(23, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()                 # [P, V]
    got = prefill_logits(ours, prompt, chunk)
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= REL_TOL


def test_greedy_generation_matches_transformers(variant):
    hf, ours = variant
    prompt = prompt_ids(11, seed=4)
    expected = hf_greedy(hf, prompt, 32)
    engine = engine_of(ours, max_context_tokens=128, prefill_chunk_tokens=4)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    assert got == expected


def test_batched_greedy_generation_matches_transformers(variant):
    """Three requests decoding together (continuous batching) each match transformers alone."""
    hf, ours = variant
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 13, 9)]
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    engine = engine_of(ours, max_running_requests=3, max_context_tokens=128)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert got == expected


@pytest.mark.parametrize("fmt,shard", [("fused", None), ("hub", "60KB"), ("fused", "60KB")],
                         ids=["fused_single", "hub_sharded", "fused_sharded"])
def test_checkpoint_layouts_load_identically(tmp_path, fmt, shard):
    """transformers' fused expert layout and sharded checkpoints load the same weights as the hub layout."""
    hf = hf_model("mixtral", seed=1)
    hub = load_model(save_hf(hf, tmp_path / "hub"), device="cpu")
    other_dir = save_hf(hf, tmp_path / "other", fmt=fmt, max_shard_size=shard)
    if shard is not None:
        assert (other_dir / "model.safetensors.index.json").is_file()
    other = load_model(other_dir, device="cpu")
    for layer in range(hub.cfg.num_layers):
        assert torch.equal(hub.model.experts.packed[layer], other.model.experts.packed[layer])
        assert torch.equal(hub.model.dense.layers[layer].router, other.model.dense.layers[layer].router)
    assert torch.equal(hub.model.dense.lm_head, other.model.dense.lm_head)
