"""The tiny built-in model: a deterministic Qwen3-MoE checkpoint with a real tokenizer.

``ensure_tiny_checkpoint()`` writes it on first use to ``$FT_CACHE_DIR/tiny-qwen3-moe`` (default
``~/.cache/ft-expert-service/tiny-qwen3-moe``) and returns the directory. Weights are seeded random
(generated on the CPU, float32); the tokenizer is a byte-level BPE trained deterministically on the
text below, with ChatML special tokens and a chat template. The embedding and lm head are a rank-H
factorisation of the text's bigram log-probabilities, and the random layers are small next to them,
so the model babbles words of that text (sample with temperature ~0.7) instead of byte soup. It
exists so that every code path (tokenize, prefill, decode, detokenize, serve) runs anywhere.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.writer import write_checkpoint
from ftexpert.gpu_worker.checkpoint.dense_weights import random_dense_weights
from ftexpert.gpu_worker.checkpoint.expert_sources import RandomExpertSource

TINY_DIR_NAME = "tiny-qwen3-moe"
TINY_VERSION = "2"              # bump when the tiny model changes; old caches are rebuilt
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
<|im_start|>user
Hello!<|im_end|>
<|im_start|>assistant
Hello! How are you today?<|im_end|>
<|im_start|>user
What is a mixture of experts?<|im_end|>
<|im_start|>assistant
A model that lets a router choose a few experts for each token.<|im_end|>
<|im_start|>user
Tell me a story.<|im_end|>
<|im_start|>assistant
Once upon a time there was a small model that wanted to speak.<|im_end|>
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


def bigram_factors(tok: Tokenizer, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed [V, H], lm_head [V, H]) with embed[a] . lm_head[b] ~ log P(b | a) in TRAINING_TEXT
    (row-centred, add-a-little smoothing); embed rows have mean RMS 1."""
    vocab = tok.get_vocab_size()
    ids = torch.tensor(tok.encode(TRAINING_TEXT).ids)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1, dtype=torch.float64), accumulate=True)
    unigram = torch.bincount(ids, minlength=vocab).double() + 0.1
    probs = counts + 0.01 * unigram / unigram.sum()
    logp = (probs / probs.sum(1, keepdim=True)).log()
    logp = logp - logp.mean(1, keepdim=True)                       # softmax ignores a row constant
    u, s, vh = torch.linalg.svd(logp)
    embed = u[:, :hidden] * s[:hidden].sqrt()                      # [V, H]
    lm_head = vh[:hidden].T * s[:hidden].sqrt()                    # [V, H]
    scale = embed.pow(2).mean(1).sqrt().mean()
    return (embed / scale).float(), (lm_head * scale).float()


def write_tiny_checkpoint(out_dir: str | Path) -> Path:
    tok = build_tokenizer()
    eos_ids = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    cfg = tiny_config(tok.get_vocab_size(), eos_ids)
    dense = random_dense_weights(cfg, "cpu", torch.float32, TINY_SEED)
    dense.embed, dense.lm_head = bigram_factors(tok, cfg.hidden_size)
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
