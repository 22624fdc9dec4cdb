"""The tiny built-in model: a deterministic Qwen3-MoE checkpoint with a real tokenizer.

``ensure_tiny_checkpoint()`` writes it on first use to ``$FT_CACHE_DIR/tiny-qwen3-moe`` (default
``~/.cache/ft-expert-service/tiny-qwen3-moe``) and returns the directory. Weights are seeded random
(generated on the CPU, float32); the tokenizer is a byte-level BPE trained deterministically on the
text below, with ChatML special tokens and a chat template. Its output is fluent-looking nonsense:
it exists so that every code path (tokenize, prefill, decode, detokenize, serve) runs anywhere.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import MoeConfig
from .checkpoint_writer import write_checkpoint
from .dense_weights import random_dense_weights
from .expert_sources import RandomExpertSource

TINY_DIR_NAME = "tiny-qwen3-moe"
TINY_VERSION = "1"              # bump when the tiny model changes; old caches are rebuilt
TINY_SEED = 1234
TINY_BPE_VOCAB = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRAINING_TEXT = """\
A mixture of experts model keeps many small feed forward networks in every layer and lets a router
choose a few of them for each token. Most of the weights are experts, and most experts are idle for
any one token. The experts of a large model do not fit on the graphics card, so they live in host
memory. The card keeps a cache of expert slots. When the router picks an expert that is already in
a slot, the card computes it at once. When the expert is missing, the worker either copies it over
the bus into a slot or asks a processor core to compute it in place.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time there was a small model that wanted to speak. It read a few lines of text, learned
a few hundred words and began to write stories about foxes, dogs, boxes, caches and cards.
The weather is warm and the sky is clear. We walked to the river, sat in the shade and talked about
numbers, words, music and the sea. One, two, three, four, five, six, seven, eight, nine, ten.
Question: what is two plus two? Answer: four. Question: what colour is the sky? Answer: blue.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
"""


def cache_root() -> Path:
    env = os.environ.get("FT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ft-expert-service"


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on TRAINING_TEXT; the same merges every run (single-threaded input)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_BPE_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    return tok


def tiny_config(vocab_size: int, eos_ids: tuple[int, ...]) -> MoeConfig:
    return MoeConfig(
        arch="qwen3", vocab_size=vocab_size, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, num_experts=8, top_k=2, expert_intermediate_size=64, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=32768, norm_topk_prob=True,
        tie_word_embeddings=False, dtype="float32", bos_token_id=None, eos_token_ids=eos_ids,
        extra={"intermediate_size": 128, "initializer_range": 0.02})


def tokenizer_files(tok: Tokenizer, eos_ids: tuple[int, ...]) -> dict[str, str]:
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tok_config, indent=2),
        "generation_config.json": json.dumps({"eos_token_id": list(eos_ids), "bos_token_id": None}, indent=2),
        "ft_tiny_version.txt": TINY_VERSION,
    }


def write_tiny_checkpoint(out_dir: str | Path) -> Path:
    tok = build_tokenizer()
    eos_ids = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    cfg = tiny_config(tok.get_vocab_size(), eos_ids)
    dense = random_dense_weights(cfg, "cpu", torch.float32, TINY_SEED)
    experts = RandomExpertSource(cfg, torch.float32, TINY_SEED, std=0.02)
    return write_checkpoint(out_dir, cfg, dense, experts, extra_files=tokenizer_files(tok, eos_ids))


def ensure_tiny_checkpoint(root: str | Path | None = None) -> Path:
    """The tiny checkpoint's directory, written on first use (or rebuilt if its version is stale)."""
    out = Path(root) if root is not None else cache_root() / TINY_DIR_NAME
    marker = out / "ft_tiny_version.txt"
    if marker.is_file() and marker.read_text().strip() == TINY_VERSION:
        return out
    if out.exists():                       # stale or partial: move it aside, then rebuild
        stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
        out.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_checkpoint(out)
