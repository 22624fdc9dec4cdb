"""Presets (real shapes, seeded random weights) and the tiny built-in model."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.attention import PrefillAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.checkpoint import presets as presets_mod
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.tiny import TRAINING_TEXT, ensure_tiny_checkpoint
from ftexpert.gpu_worker.checkpoint.tokenizer import TextTokenizer
from tests.built_engines import build
from tests.gpu_worker.test_models_util import rel_err


def mini(arch: str) -> MoeConfig:
    """A preset-like config small enough for CI."""
    return MoeConfig(arch=arch, vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=8, top_k=2, expert_intermediate_size=32, rms_norm_eps=1e-5,
                     rope_theta=1e6, max_position_embeddings=512, norm_topk_prob=arch != "olmoe",
                     dtype="float32", eos_token_ids=(3,), extra={"initializer_range": 0.3})


def test_real_model_shapes():
    q = presets_mod.preset_config("qwen3-30b-a3b")
    assert (q.num_layers, q.num_experts, q.top_k, q.hidden_size, q.expert_intermediate_size) == (48, 128, 8, 2048, 768)
    assert (q.num_heads, q.num_kv_heads, q.head_dim, q.vocab_size, q.dtype) == (32, 4, 128, 151936, "bfloat16")
    o = presets_mod.preset_config("olmoe-1b-7b")
    assert (o.num_layers, o.num_experts, o.top_k, o.expert_intermediate_size, o.vocab_size) == (16, 64, 8, 1024, 50304)
    m = presets_mod.preset_config("mixtral-8x7b")
    assert (m.num_layers, m.num_experts, m.top_k, m.hidden_size, m.expert_intermediate_size) == (32, 8, 2, 4096, 14336)
    assert "9.00 MiB an expert" in presets_mod.describe(q)          # 3 * 2048 * 768 * 2 bytes
    with pytest.raises(ValueError, match="unknown preset 'qwen4'.*qwen3-30b-a3b"):
        presets_mod.preset_config("qwen4")


@pytest.mark.parametrize("arch", ["qwen3", "olmoe", "mixtral"])
def test_preset_in_memory_equals_preset_written_to_disk(monkeypatch, tmp_path, arch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(presets_mod.PRESETS, "mini", mini(arch))
    in_memory = load_model(preset="mini", device="cpu", seed=5)
    on_disk = load_model(tmp_path / "mini", preset="mini", device="cpu", seed=5)
    assert (tmp_path / "mini" / "model.safetensors.index.json").is_file()
    assert "random weights" in in_memory.source.description and "checkpoint" in on_disk.source.description
    for layer in range(2):
        assert torch.equal(in_memory.model.experts.packed[layer], on_disk.model.experts.packed[layer])
        assert torch.equal(in_memory.model.dense.layers[layer].q_proj, on_disk.model.dense.layers[layer].q_proj)
    other_seed = load_model(preset="mini", device="cpu", seed=6)
    assert not torch.equal(other_seed.model.experts.packed[0], in_memory.model.experts.packed[0])


@pytest.mark.parametrize("arch", ["qwen3", "olmoe", "mixtral"])
def test_transformers_reads_our_checkpoints(monkeypatch, tmp_path, arch):
    """What write_checkpoint writes (hub per-expert names, sharded) loads in transformers with the same logits."""
    import transformers
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(presets_mod.PRESETS, "mini", mini(arch))
    ours = build(tmp_path / "mini", preset="mini", seed_weights=1, max_context_tokens=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "mini"), dtype=torch.float32).eval()
    prompt = torch.arange(1, 20) * 5 % 96
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
    attn = PrefillAttention(KVCache(ours.model.cfg, 1, 64, torch.float32, torch.device("cpu")), 0, 0, len(prompt))
    got = ours.model.forward(prompt, torch.arange(len(prompt)), attn)
    assert rel_err(got, expected) <= 1e-4


def test_tiny_checkpoint_is_deterministic_and_cached(tmp_path):
    a = ensure_tiny_checkpoint(tmp_path / "a")
    b = ensure_tiny_checkpoint(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp            # not rewritten
    (a / "ft_tiny_version.txt").write_text("0")                              # stale: rebuilt
    ensure_tiny_checkpoint(tmp_path / "a")
    assert (a / "ft_tiny_version.txt").read_text() != "0"


def test_tiny_default_speaks(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    loaded = build(max_context_tokens=256)
    assert (tmp_path / "tiny-qwen3-moe" / "config.json").is_file()
    tok = loaded.source.tokenizer
    assert isinstance(tok, TextTokenizer) and tok.vocab_size == loaded.cfg.vocab_size
    assert tok.decode(tok.encode("The quick brown fox")) == "The quick brown fox"
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    assert im_end in loaded.source.eos_token_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert chat == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    engine = loaded.engine                                       # (its EOS ids: the checkpoint's)
    out = engine.generate([tok.encode("The weather is")], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    words = tok.decode(out).split()
    known = set(TRAINING_TEXT.split())
    assert len(words) >= 5 and sum(w in known for w in words) >= len(words) // 2     # words of its text
