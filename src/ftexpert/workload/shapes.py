"""The shapes ``train_moe`` trains. The routing shape (layers, experts, top-k, router
normalisation) of the two ``*-routing`` shapes is that of the checkpoint they are named after; their
widths are chosen small enough to train in about ten minutes on one H200."""
from __future__ import annotations

from dataclasses import dataclass

from ftexpert.workload.model import ModelConfig


@dataclass(frozen=True)
class Shape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    seq_len: int
    batch_size: int          # sequences per step
    lr: float
    warmup_steps: int
    tokens: int              # default training budget (--tokens)
    tokenizer_docs: int      # training documents the tokenizer is trained on (0: all)
    corpus_docs: int         # training documents trained on (0: all)

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            num_experts=self.num_experts, top_k=self.top_k,
            moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
            max_position_embeddings=max(4096, self.seq_len))


SHAPES = {s.name: s for s in (
    # CI and the embedded default: trains on 2 CPU cores in about a minute.
    Shape("tiny", vocab_size=2048, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
          head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=64, norm_topk_prob=True,
          seq_len=128, batch_size=16, lr=5e-3, warmup_steps=10, tokens=300_000, tokenizer_docs=300,
          corpus_docs=400),
    # The embedded default model of `ft serve` / `ft generate` (no --model): small enough to ship in the
    # package (about 5.6 MB in bfloat16), trained on the GPU in about two minutes.
    Shape("default", vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
          head_dim=32, num_experts=8, top_k=2, moe_intermediate_size=128, norm_topk_prob=True,
          seq_len=256, batch_size=64, lr=3e-3, warmup_steps=50, tokens=40_000_000, tokenizer_docs=0,
          corpus_docs=0),
    # OLMoE-1B-7B's routing: 16 layers, 64 experts, top-8, top-k weights not renormalised.
    Shape("olmoe-routing", vocab_size=8192, hidden_size=512, num_layers=16, num_heads=8, num_kv_heads=4,
          head_dim=64, num_experts=64, top_k=8, moe_intermediate_size=256, norm_topk_prob=False,
          seq_len=512, batch_size=64, lr=1.5e-3, warmup_steps=100, tokens=100_000_000,
          tokenizer_docs=0, corpus_docs=0),
    # Qwen3-30B-A3B's routing: 48 layers, 128 experts, top-8, top-k weights renormalised.
    Shape("qwen3-30b-a3b-routing", vocab_size=8192, hidden_size=384, num_layers=48, num_heads=6,
          num_kv_heads=2, head_dim=64, num_experts=128, top_k=8, moe_intermediate_size=128,
          norm_topk_prob=True, seq_len=512, batch_size=32, lr=1e-3, warmup_steps=100,
          tokens=60_000_000, tokenizer_docs=0, corpus_docs=0),
)}
