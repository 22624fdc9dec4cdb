"""`Engine`: the GPU worker's decode loop, one ``step()`` at a time.

    engine = Engine(model, EngineConfig(max_running_requests=4))
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=64))
    while engine.has_work():
        for request_id, token_id, finished, finish_reason in engine.step():
            ...

Not thread-safe: one thread (the front door's engine loop) calls every method. ``step`` runs at most
one prefill chunk and one decode forward (see scheduler.py) and returns every token made in it.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from ..models.model import MoeModel
from .attention import ATTENTION_BACKENDS, DecodeAttention, PrefillAttention, decode_bucket_tokens
from .kv_cache import KVCache
from .request import Request, StepOutput
from .sampling import FINISH_ABORT, RequestSampler, SamplingParams, sample_batch
from .scheduler import PrefillChunk, Scheduler
from .stats import EngineStats

DEFAULT_MAX_CONTEXT_TOKENS = 32768
# Prompt tokens a prefill chunk takes unless the config or the expert backend (`preferred_prefill_chunk_tokens`:
# HybridExperts with strategy `cpu`, whose chunks keep their CPU share) says otherwise. On the H200 (qwen3-30b-a3b, 4K prompt; docs/BENCHMARKS.md,
# thirteenth and fourteenth sessions) resident took 0.60 / 0.20 / 0.17 s at chunks of 512 / 2048 / 4096, offload at
# a 10% cache 8.52 / 2.13 / 1.07 s (every chunk costs one pass over the experts, whatever its length), and hybrid at
# 25% 7.48 s in 512-token chunks with their CPU share against 1.07 s as one chunk (run as offload, with the
# prefetch). Every backend takes the same size, so that their greedy tokens stay equal (the chunking decides the
# prefill GEMMs' shapes). The costs: a chunk holds up the other running requests' decode steps while it runs
# (~0.13 s resident at 4096); where the flash path does not apply (CPU, fp32, sliding windows) late in a long
# context its attention bias takes G x chunk x context x 2 bytes (2 GiB for qwen3-30b-a3b at 4096 x 32K);
# `--prefill-chunk-tokens` sets another size.
DEFAULT_PREFILL_CHUNK_TOKENS = 4096


DECODE_ATTEMPTS = 2      # a decode step the expert backend failed is run once more (it then fetches)
SLOT_AUDIT_SAMPLE = 2    # a slot audit compares the most recently used slots whole with the expert store ...
SLOT_AUDIT_PROBES = 64   # ... and three windows of this many other slots, drawn at random

log = logging.getLogger("ft.engine")

@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int = 4          # KV cache rows = requests decoding together
    max_context_tokens: int | None = None  # None: min(32768, the model's max_position_embeddings)
    prefill_chunk_tokens: int | None = None  # None: the expert backend's preference, else DEFAULT_PREFILL_CHUNK_TOKENS
    cuda_graphs: bool = True               # replay decode forwards from CUDA graphs where safe
    attention_backend: str = "auto"        # decode attention: "triton" | "sdpa"; auto: triton on CUDA
    slot_audit_every: int = 0              # every N decode steps, audit the expert slot cache (0: never;
                                           # FREETOKEN_MOE_SLOT_AUDIT; docs/slot_cache.md)

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens={self.prefill_chunk_tokens} must be >= 1")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens={self.max_context_tokens} must be >= 2")
        if isinstance(self.slot_audit_every, bool) or not isinstance(self.slot_audit_every, int) \
                or self.slot_audit_every < 0:
            raise ValueError(f"slot_audit_every={self.slot_audit_every!r} must be an integer >= 0 (0: never)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")


@dataclass(frozen=True)
class DecodeInputs:
    """Everything a decode forward needs; the CUDA-graph runner copies these into static buffers."""
    token_ids: torch.Tensor     # [T] int64, device: the last token of each request
    positions: torch.Tensor     # [T] int64, device: its position (seq_len - 1)
    slot_ids: torch.Tensor      # [T] int64, device: KV cache row
    num_rows: int               # R: KV rows attended (max slot id + 1)
    bucket_tokens: int          # attention span (>= max position + 1)
    rows_are_slots: bool        # slot_ids == arange(T)


class Engine:
    def __init__(self, model: MoeModel, config: EngineConfig | None = None,
                 eos_token_ids: Iterable[int] | None = None):
        self.model, self.config = model, config or EngineConfig()
        cfg = model.cfg
        self.max_context_tokens = (self.config.max_context_tokens
                                   or min(DEFAULT_MAX_CONTEXT_TOKENS, cfg.max_position_embeddings))
        model.ensure_positions(self.max_context_tokens)
        self._audit_skip_logged = False
        self.device = model.device
        self.eos_token_ids = frozenset(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.kv = KVCache(cfg, self.config.max_running_requests, self.max_context_tokens, model.dtype,
                          self.device)
        self.prefill_chunk_tokens = (self.config.prefill_chunk_tokens
                                     or getattr(model.experts, "preferred_prefill_chunk_tokens", None)
                                     or DEFAULT_PREFILL_CHUNK_TOKENS)
        self.scheduler = Scheduler(self.config.max_running_requests, self.prefill_chunk_tokens)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self.graphs = None
        if self.config.cuda_graphs and self.device.type == "cuda":
            from .cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self)

    # ---- public API ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request; returns its id (``request_id`` or a fresh int). Raises ValueError on bad input."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty; send at least one token")
        if len(prompt_ids) > self.max_context_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, more than max_context_tokens="
                             f"{self.max_context_tokens}; shorten it or raise max_context_tokens")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if request_id is None:
            request_id = next(self._ids)
            while self.scheduler.find(request_id) is not None:   # a caller used this int already
                request_id = next(self._ids)
        elif self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.add(Request(request_id, prompt_ids, params, RequestSampler(params, self.device),
                                   self.eos_token_ids, self.max_context_tokens))
        self.stats.requests_added += 1
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Drop a waiting or running request and free its KV row; False if it is unknown or done."""
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        req.finish_reason = FINISH_ABORT
        self.scheduler.remove(req)
        self.stats.requests_aborted += 1
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one decode forward and/or one prefill chunk; return the tokens they made."""
        plan = self.scheduler.plan()
        if plan.empty:
            return []
        self.stats.num_steps += 1
        outputs: list[StepOutput] = []
        if plan.decode:
            outputs += self._decode(plan.decode)
        if plan.prefill is not None:
            outputs += self._prefill(plan.prefill)
        for out in outputs:
            if out.finished:
                self.scheduler.remove(self.scheduler.find(out.request_id))
                self.stats.requests_finished += 1
        self.stats.generated_tokens += len(outputs)
        counters = getattr(self.model.experts, "counters", None)
        if counters is not None:                  # offload / cpu / hybrid: stats, metrics, the policy tuner
            self.stats.absorb_expert_counters(counters())
        return outputs

    def set_policy(self, **fields) -> None:
        """The coordinator's fetch policy (strategy, fetch_fraction, fetch_round, fetch_select, ...), passed
        to the expert backend when it takes one (cpu / hybrid); other backends ignore it."""
        setter = getattr(self.model.experts, "set_policy", None)
        if setter is not None:
            setter(**fields)

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Run ``prompts`` to completion on an idle engine; the generated ids of each, in order."""
        if self.has_work():
            raise RuntimeError("generate() needs an idle engine; drive step() yourself when serving")
        ids = [self.add_request(p, params) for p in prompts]
        tokens: dict[Hashable, list[int]] = {i: [] for i in ids}
        while self.has_work():
            for out in self.step():
                tokens[out.request_id].append(out.new_token_id)
        return [tokens[i] for i in ids]

    # ---- forwards -----------------------------------------------------------------------------
    def _prefill(self, chunk: PrefillChunk) -> list[StepOutput]:
        t0 = time.perf_counter()
        req, start, n = chunk.request, chunk.start_pos, chunk.num_tokens
        token_ids = torch.tensor(req.prompt_ids[start:start + n], dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + n, dtype=torch.int64, device=self.device)
        attn = PrefillAttention(self.kv, req.slot, start, n, self.model.cfg.sliding_window)
        rows = torch.tensor([n - 1] if chunk.is_last else [], dtype=torch.int64, device=self.device)
        logits = self.model.forward(token_ids, positions, attn, logit_rows=rows)      # [0 or 1, V]
        req.num_prefilled += n
        outputs = []
        if chunk.is_last:
            token = int(req.sampler.sample(logits[0]))                               # host sync
            outputs.append(req.append_token(token, time.perf_counter()))
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)                                       # honest timing
        self.stats.num_prefill_chunks += 1
        self.stats.prefill_tokens += n
        self.stats.prefill_time_s += time.perf_counter() - t0
        return outputs

    def decode_inputs(self, reqs: list[Request]) -> DecodeInputs:
        slots = [r.slot for r in reqs]
        host = torch.tensor([[r.output_ids[-1] for r in reqs], [r.seq_len - 1 for r in reqs], slots],
                            dtype=torch.int64)                                        # [3, T]
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        max_len = max(r.seq_len for r in reqs)
        return DecodeInputs(dev[0], dev[1], dev[2], num_rows=max(slots) + 1,
                            bucket_tokens=decode_bucket_tokens(max_len, self.max_context_tokens),
                            rows_are_slots=slots == list(range(len(reqs))))

    def decode_forward(self, inputs: DecodeInputs) -> torch.Tensor:
        """One token per request -> logits [T, V] fp32. Fixed shapes for (T, R, bucket); no host sync
        unless the expert backend makes one."""
        attn = DecodeAttention(self.kv, inputs.slot_ids, inputs.positions, inputs.num_rows,
                               inputs.bucket_tokens, inputs.rows_are_slots, self.model.cfg.sliding_window,
                               backend=self.config.attention_backend)
        return self.model.forward(inputs.token_ids, inputs.positions, attn)

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        t0 = time.perf_counter()
        inputs = self.decode_inputs(reqs)
        experts = self.model.experts
        begin, end = getattr(experts, "step_begin", None), getattr(experts, "step_end", None)
        for attempt in range(DECODE_ATTEMPTS):
            if begin is not None:
                begin()
            if self.graphs is not None and self.graphs.usable(len(reqs)):
                logits = self.graphs.run(inputs)
            else:
                logits = self.decode_forward(inputs)
            # A backend whose step can fail inside a graph (the device hand-off) says so here; it has then
            # switched to fetching, and the step runs again (it rewrites the same K/V rows).
            if end is None or end():
                break
            self.stats.decode_step_retries += 1
        else:
            raise RuntimeError(f"the expert backend failed the decode step {DECODE_ATTEMPTS} times (its re-run "
                               "fetches every miss and should not fail); see the log for the cause")
        token_ids = sample_batch([r.sampler for r in reqs], logits)                   # host sync
        now = time.perf_counter()
        self.stats.num_decode_steps += 1
        self.stats.decode_tokens += len(reqs)
        self.stats.decode_time_s += now - t0
        every = self.config.slot_audit_every
        if every and self.stats.num_decode_steps % every == 0:
            self._audit_slots(experts)
        return [r.append_token(t, now) for r, t in zip(reqs, token_ids)]

    def _audit_slots(self, experts) -> None:
        """The slot audit (EngineConfig.slot_audit_every): check the backend's slot cache on the host, and on a
        problem log it, count it and empty the cache, so later steps fetch every expert again instead of
        computing with a slot that does not hold its expert. The step just sampled used the cache as it was."""
        audit = getattr(experts, "audit_slots", None)
        if audit is None:                                  # no slot cache (resident, cpu), or wrapped
            if not self._audit_skip_logged:
                self._audit_skip_logged = True
                log.info("slot audit: the %s backend has no slot cache to audit", type(experts).__name__)
            return
        self.stats.slot_audits += 1
        try:
            problems = audit(SLOT_AUDIT_SAMPLE, SLOT_AUDIT_PROBES, seed=self.stats.num_decode_steps)
        except Exception:                                   # a check must not lose the step's tokens
            self.stats.slot_audit_failures += 1
            log.exception("slot cache audit after decode step %d could not run", self.stats.num_decode_steps)
            return
        if problems:
            self.stats.slot_audit_failures += 1
            log.error("slot cache audit after decode step %d found: %s; emptying the cache (later steps fetch "
                      "again)", self.stats.num_decode_steps, "; ".join(problems))
            experts.reset_slots()
