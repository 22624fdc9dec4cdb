"""`SamplingParams`: how one request is sampled, built and validated once at the front door (HTTP or
gRPC), carried as is through the engine link (a field of ADD_REQUEST) and used by the GPU worker's
sampler. `TokenLogprobs`: what the sampler reports of one token when its request asked for logprobs.
`check_prompt` is the one check of a prompt against the engine's context.

Logprobs are taken from the distribution the token was drawn from: log-softmax of the logits after the grammar
mask (proto/grammar_spec.py) and the temperature (a greedy request counts as temperature 1), with top-k and top-p
applied (tokens they cut are -inf: never listed, and the kept ones renormalized).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ftexpert.proto.grammar_spec import GrammarSpec

MAX_LOGPROBS = 20           # alternatives reported per token at most (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0             # 0 = greedy
    top_p: float = 1.0                   # nucleus mass kept, in (0, 1]
    top_k: int = 0                       # 0 = no top-k cut
    seed: int | None = None              # None: a fresh random seed per request
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None          # None: none; n: the token's logprob and the n most likely alternatives
    grammar: GrammarSpec | None = None   # the output must match it (a token mask in the sampler)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise BadSamplingParam("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise BadSamplingParam("temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise BadSamplingParam("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise BadSamplingParam("top_k", f"must be 0 (off) or >= 1, got {self.top_k!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise BadSamplingParam("logprobs", f"must be None or an integer from 0 to {MAX_LOGPROBS}, got "
                                               f"{self.logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise BadSamplingParam("grammar", f"must be a GrammarSpec, got {type(self.grammar).__name__}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenLogprobs(NamedTuple):
    """One generated token's logprob and its most likely alternatives (ids and logprobs, best first; as many as
    the request asked for, fewer where fewer tokens had a chance)."""
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class BadSamplingParam(ValueError):
    """One field of SamplingParams is out of range; `field` names it (a front door maps it to its parameter)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


class PromptTooLong(ValueError):
    """The prompt (with the tokens asked for) does not fit the engine's context; `param` names the culprit."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int | None, context_length: int, vocab_size: int,
                 max_tokens_param: str = "max_tokens") -> int:
    """Check a prompt against the engine's context and vocabulary; returns max_new_tokens (None: the rest of
    the context). ValueError for an empty prompt or an id outside [0, vocab_size); PromptTooLong when the
    prompt leaves no room or the prompt plus max_new_tokens (named `max_tokens_param`) exceeds the context."""
    n = len(prompt_ids)
    if not n:
        raise ValueError("the prompt is empty (no tokens); send some text")
    if n >= context_length:             # before the vocabulary scan: a huge prompt costs one len()
        raise PromptTooLong(f"This model's maximum context length is {context_length} tokens, but the prompt has "
                            f"{n} tokens; shorten the prompt", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if max_new_tokens is None:
        return context_length - n
    if n + max_new_tokens > context_length:
        raise PromptTooLong(f"This model's maximum context length is {context_length} tokens; the prompt has {n} "
                            f"and '{max_tokens_param}' asks for {max_new_tokens} more; lower '{max_tokens_param}' "
                            f"to at most {context_length - n}", max_tokens_param)
    return max_new_tokens
