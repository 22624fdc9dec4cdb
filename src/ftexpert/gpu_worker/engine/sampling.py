"""The sampler: greedy, or temperature + top-k + top-p with a per-request seed, as a request's
`SamplingParams` (proto/sampling_params.py: built once at the front door, carried as is) ask.

Reproducible: a request with a seed draws from its own generator, so its tokens do not depend on
which other requests share its batch (given identical logits).
"""
from __future__ import annotations

import random

import torch

from ftexpert.proto.sampling_params import SamplingParams

FINISH_STOP = "stop"        # EOS or a stop token id was generated
FINISH_LENGTH = "length"    # max_new_tokens reached, or the context is full
FINISH_ABORT = "abort"      # Engine.abort


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
