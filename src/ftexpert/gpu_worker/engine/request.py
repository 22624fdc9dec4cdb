"""A request's life in the engine: waiting -> prefilling (chunk by chunk) -> decoding -> finished.

A request preempted (its KV blocks taken back when the pool runs out: scheduler.py) goes back to waiting with its
output kept; when it runs again, its prefill recomputes the K/V of its prompt and its output but the last token
(`prefill_len`), which the next decode step feeds as usual, and samples nothing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple

from ftexpert.gpu_worker.engine.sampling import FINISH_LENGTH, FINISH_STOP, RequestSampler, SamplingParams
from ftexpert.proto.sampling_params import TokenLogprobs


class StepOutput(NamedTuple):
    """One new token of one request; unpacks as (request_id, new_token_id, finished, finish_reason, logprobs)."""
    request_id: Hashable
    new_token_id: int
    finished: bool
    finish_reason: str | None   # "stop" | "length" | None while running
    logprobs: TokenLogprobs | None = None     # when the request asked for them (SamplingParams.logprobs)


@dataclass
class Request:
    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RequestSampler
    eos_token_ids: frozenset[int]
    max_context_tokens: int
    slot: int | None = None                 # block table row (and state cache row) while running
    num_prefilled: int = 0                  # tokens of the sequence the prefill put in the KV cache (or found there)
    prefill_len: int = 0                    # tokens the prefill puts there before decoding (0: the prompt's)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)           # its KV blocks, in position order (kv_blocks.py)
    num_registered: int = 0                 # of those, the leading full ones already named in the prefix cache
    block_keys: list[bytes] = field(default_factory=list)     # prefix keys of its full blocks computed so far
    # the KV cache's window group (window_blocks.py): its blocks from block window_first on, those below
    # window_registered already named in the prefix cache
    window_blocks: list[int] = field(default_factory=list)
    window_first: int = 0
    window_registered: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    arrival_time_s: float = field(default_factory=time.perf_counter)
    first_token_time_s: float | None = None
    finish_time_s: float | None = None

    def __post_init__(self) -> None:
        if not self.prefill_len:
            self.prefill_len = len(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_prefilled < self.prefill_len

    @property
    def num_kv_tokens(self) -> int:
        """Positions whose K/V the request's blocks hold (as of its last step read back)."""
        return self.num_prefilled if self.in_prefill else self.seq_len - 1

    def sequence_ids(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + output."""
        prompt, end = self.num_prompt_tokens, start + n
        if start >= prompt:
            return self.output_ids[start - prompt:end - prompt]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - prompt)]

    def restart(self) -> None:
        """Preempted (its blocks already taken back): its next prefill recomputes every token but the last."""
        self.num_prefilled = 0
        self.prefill_len = self.seq_len - 1 if self.output_ids else self.num_prompt_tokens
        self.num_registered = 0
        self.preemptions += 1

    @property
    def seq_len(self) -> int:
        """Tokens of this request so far (prompt + generated)."""
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int, now_s: float, logprobs: TokenLogprobs | None = None) -> StepOutput:
        """Record a generated token and decide whether the request is finished. A constrained request whose
        grammar is complete after this token (only EOS may follow) finishes here with "stop"."""
        self.output_ids.append(token_id)
        if self.first_token_time_s is None:
            self.first_token_time_s = now_s
        p = self.params
        grammar = self.sampler.grammar
        if grammar is not None:
            grammar.accept(token_id)
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids) \
                or (grammar is not None and grammar.done):
            self.finish_reason = FINISH_STOP
        elif len(self.output_ids) >= p.max_new_tokens or self.seq_len > self.max_context_tokens:
            # seq_len > max_context_tokens: the token just made has no KV position left to be fed at
            self.finish_reason = FINISH_LENGTH
        if self.finished:
            self.finish_time_s = now_s
        return StepOutput(self.request_id, token_id, self.finished, self.finish_reason, logprobs)
