"""`SamplingParams` and the sampler: greedy, or temperature + top-k + top-p with a per-request seed.

Reproducible: a request with a seed draws from its own generator, so its tokens do not depend on
which other requests share its batch (given identical logits).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

FINISH_STOP = "stop"        # EOS or a stop token id was generated
FINISH_LENGTH = "length"    # max_new_tokens reached, or the context is full
FINISH_ABORT = "abort"      # Engine.abort


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0             # 0 = greedy
    top_p: float = 1.0                   # nucleus mass kept, in (0, 1]
    top_k: int = 0                       # 0 = no top-k cut
    seed: int | None = None              # None: a fresh random seed per request
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestSampler:
    """Samples one request's tokens; owns its generator (on the logits' device)."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def filtered_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] fp32 -> probabilities [V] after temperature, top-k and top-p."""
        p = self.params
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs    # mass of strictly better tokens
            sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)  # keeps at least the best
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        return probs

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] fp32 -> token id, a 0-d int64 tensor on the logits' device."""
        if self.generator is None:
            return torch.argmax(logits)
        probs = self.filtered_probs(logits)
        return torch.multinomial(probs, 1, generator=self.generator)[0]


def sample_batch_device(samplers: list[RequestSampler], logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32, one sampler per row -> [B] int64 token ids on the logits' device (no host sync)."""
    if all(s.generator is None for s in samplers):
        return torch.argmax(logits, dim=-1)
    return torch.stack([s.sample(logits[i]) for i, s in enumerate(samplers)])


def sample_batch(samplers: list[RequestSampler], logits: torch.Tensor) -> list[int]:
    """logits [B, V] fp32, one sampler per row -> B token ids (one host sync for the batch)."""
    return sample_batch_device(samplers, logits).tolist()
