"""The embedded default model (`ft serve` / `ft generate` without --model): a small trained MoE shipped in
the package that transformers loads with the same greedy tokens, and that answers a chat prompt in words."""
from __future__ import annotations

import json
import re

import pytest
import torch

from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR
from ftexpert.workload import corpus
from ftexpert.workload.checkpoint import load_checkpoint

transformers = pytest.importorskip("transformers")


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text.lower())


def test_the_default_model_is_a_trained_supported_checkpoint():
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    meta = json.loads((DEFAULT_MODEL_DIR / "ft_workload.json").read_text())
    assert meta["shape"] == "default" and meta["tokens"] >= 10_000_000       # trained, not seeded random
    assert sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir()) < 8 * 2 ** 20   # small enough to ship


def test_transformers_and_ours_agree_and_it_answers_in_words():
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                        add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    model, tok = load_checkpoint(DEFAULT_MODEL_DIR)
    model.float()
    ours = model.greedy(prompt, len(hf_out))
    eos = set(json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())["eos_token_id"])
    stop = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    assert ours[:stop] == hf_out[:stop]
    text = tok.decode(ours[:stop])
    vocabulary = set(_words(corpus.KJV_PATH.name) + [w for d in corpus.load_documents()[:400] for w in _words(d)])
    words = _words(text)
    assert len(words) >= 2 and "user" not in words, text
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.8, f"{known:.0%} of {text!r} are words of the corpus"


def test_ft_generate_without_a_model_uses_it(capsys, monkeypatch, tmp_path):
    from ftexpert.coordinator.cli import main as ft_main
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    args = ["generate", "--chat", "--prompt", "Who are you?", "--max-new-tokens", "24", "--temperature", "0",
            "--device", "cpu", "--json"]
    assert ft_main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ft_main(args + ["--model", str(DEFAULT_MODEL_DIR)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == result["token_ids"]
    words = _words(result["text"])
    assert len(words) >= 3 and "user" not in words, result["text"]
