"""The sampler: greedy, or temperature + top-k + top-p with a per-request seed, as a request's
`SamplingParams` (proto/sampling_params.py: built once at the front door, carried as is) ask.

Reproducible: a request with a seed draws from its own generator, so its tokens do not depend on
which other requests share its batch (given identical logits).

`sample_step` is one step's sampling of a batch: the grammar mask of the constrained rows (grammar.py), the
tokens, and for the rows whose request asked for them the logprobs (`logprob_rows`: the distribution the token
was drawn from, as proto/sampling_params.py defines it). A batch with no constrained row and no logprobs row runs
`sample_batch_device` alone.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ftexpert.gpu_worker.engine.grammar import GrammarMasks, GrammarState
from ftexpert.proto.sampling_params import SamplingParams, TokenLogprobs

FINISH_STOP = "stop"        # EOS or a stop token id was generated
FINISH_LENGTH = "length"    # max_new_tokens reached, or the context is full
FINISH_ABORT = "abort"      # Engine.abort


class RequestSampler:
    """Samples one request's tokens; owns its generator (on the logits' device)."""

    def __init__(self, params: SamplingParams, device: torch.device, grammar: GrammarState | None = None):
        self.params = params
        self.grammar = grammar                 # the request's position in its grammar (None: unconstrained)
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


@dataclass
class SampledStep:
    """One step's tokens [B] (device) and, for the batch rows `rows` whose requests asked, their logprobs as
    lines [n, 1 + 2K] fp32 (device): the token's logprob, the K best logprobs, then those K tokens' ids."""
    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)     # per line: the alternatives its request asked for

    def read_logprobs(self, lines: list[list[float]]) -> dict[int, TokenLogprobs]:
        """The host copy of `logprobs` (its .tolist()) -> batch row -> TokenLogprobs (alternatives the grammar or
        top-k / top-p cut, at -inf, are left out)."""
        out = {}
        for row, k, line in zip(self.rows, self.counts, lines):
            width = (len(line) - 1) // 2
            top = [(int(t), v) for v, t in zip(line[1:1 + k], line[1 + width:1 + width + k]) if v != float("-inf")]
            out[row] = TokenLogprobs(line[0], tuple(t for t, _ in top), tuple(v for _, v in top))
        return out


def sample_step(samplers: list[RequestSampler], logits: torch.Tensor, masks: GrammarMasks | None) -> SampledStep:
    """logits [B, V] fp32 (its constrained rows are masked in place) -> the step's tokens and logprobs."""
    constrained = [i for i, s in enumerate(samplers) if s.grammar is not None]
    if constrained:
        with torch.inference_mode():             # the forward's logits are inference tensors: masked in place
            masks.apply(logits, constrained, [samplers[i].grammar for i in constrained])
    tokens = sample_batch_device(samplers, logits)
    rows = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    if not rows:
        return SampledStep(tokens)
    params = [samplers[i].params for i in rows]
    return SampledStep(tokens, logprob_rows(params, logits, tokens, rows), rows, [p.logprobs for p in params])


def logprob_rows(params: list[SamplingParams], logits: torch.Tensor, tokens: torch.Tensor,
                 rows: list[int]) -> torch.Tensor:
    """The rows `rows` of logits [B, V] (grammar-masked) and their sampled tokens [B] -> [n, 1 + 2K] fp32: each
    token's logprob, the K = max(logprobs) best logprobs and their ids, under the distribution the token was drawn
    from: logits / temperature (1 for greedy), top-k then top-p cut to -inf as RequestSampler.filtered_probs cuts,
    log-softmax. No host sync."""
    dev = logits.device
    index = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    x = logits.index_select(0, index)                                                   # [n, V]
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=x.dtype).to(dev, non_blocking=True).unsqueeze(1)
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        best = torch.topk(x, max(ks), dim=-1).values                                    # [n, kmax]
        at = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.int64).to(dev, non_blocking=True)
        kth = best.gather(1, at.unsqueeze(1))
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks]).to(dev, non_blocking=True).unsqueeze(1),
                              float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        probs = torch.softmax(x, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs                      # mass of better tokens
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).to(dev, non_blocking=True)
        cut = torch.zeros_like(before, dtype=torch.bool).scatter_(1, order, before >= top_p.unsqueeze(1))
        x = x.masked_fill(cut, float("-inf"))
    lp = torch.log_softmax(x, dim=-1)
    parts = [lp.gather(1, tokens.index_select(0, index).unsqueeze(1))]
    k = max(p.logprobs for p in params)
    if k:
        top = torch.topk(lp, k, dim=-1)
        parts += [top.values, top.indices.to(lp.dtype)]                                  # ids < 2^24: exact
    return torch.cat(parts, dim=1)
