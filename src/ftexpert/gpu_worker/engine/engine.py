"""`Engine`: the GPU worker's decode loop, one ``step()`` at a time.

    engine = Engine(model, EngineConfig(max_running_requests=4))
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=64))
    while engine.has_work():
        for request_id, token_id, finished, finish_reason, logprobs in engine.step():
            ...

Not thread-safe: one thread (the front door's engine loop) calls every method. ``step`` runs at most
one prefill chunk and one decode forward (see scheduler.py) and returns every token made in it; with
``EngineConfig.overlap_decode`` it may also queue the next decode forward, and return the tokens of one
queued by the call before (so a request can get two tokens from one call).

A request with a grammar (SamplingParams.grammar) is sampled under its token mask (grammar.py): the mask of its
next token depends on the token just sampled, so no decode step is queued ahead while one is in the batch; its mask
is computed on the host while the GPU runs the step's forward.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from ftexpert.gpu_worker.models.model import MoeModel
from ftexpert.gpu_worker.models.qwen3_next import StatefulContext
from ftexpert.gpu_worker.engine.attention import ATTENTION_BACKENDS, PrefillAttention, decode_bucket_tokens
from ftexpert.gpu_worker.engine.cuda_graphs import DecodeGraphs
from ftexpert.gpu_worker.engine.decode_step import DecodeInputs, decode_forward
from ftexpert.gpu_worker.engine.grammar import GrammarCompiler, GrammarMasks
from ftexpert.gpu_worker.engine.kv_blocks import KVBlocks
from ftexpert.gpu_worker.engine.kv_cache import DEFAULT_KV_BLOCK_SIZE, KVCache, pool_sizes
from ftexpert.gpu_worker.engine.state_cache import StateCache
from ftexpert.gpu_worker.engine.state_checkpoints import StateCheckpoints
from ftexpert.gpu_worker.engine.request import Request, StepOutput
from ftexpert.gpu_worker.engine.sampling import FINISH_ABORT, RequestSampler, SampledStep, SamplingParams, sample_step
from ftexpert.gpu_worker.engine.scheduler import PrefillChunk, Scheduler
from ftexpert.gpu_worker.engine.stats import EngineStats
from ftexpert.proto.sampling_params import TokenLogprobs

DEFAULT_MAX_CONTEXT_TOKENS = 32768
# Prompt tokens a prefill chunk takes unless the config or the expert backend (`preferred_prefill_chunk_tokens`:
# HybridExperts with strategy `cpu`, whose chunks keep their CPU share) says otherwise. On the H200 (qwen3-30b-a3b, 4K
# prompt) resident took 0.60 / 0.20 / 0.17 s at chunks of 512 / 2048 / 4096, offload at a 10% cache 8.52 / 2.13 /
# 1.07 s (every chunk costs one pass over the experts, whatever its length; docs/BENCHMARKS.md, "Prefill: time to
# first token"), and hybrid at 25% 7.48 s in 512-token chunks with their CPU share against 1.07 s as one chunk (run
# as offload, with the prefetch). Every backend takes the same size, so that their greedy tokens stay equal (the
# chunking decides the prefill GEMMs' shapes). The costs: a chunk holds up the other running requests' decode steps while it runs
# (~0.13 s resident at 4096); where the flash path does not apply (CPU, fp32, sliding windows) late in a long
# context its attention bias takes G x chunk x context x 2 bytes (2 GiB for qwen3-30b-a3b at 4096 x 32K);
# `--prefill-chunk-tokens` sets another size.
DEFAULT_PREFILL_CHUNK_TOKENS = 4096


DECODE_ATTEMPTS = 2      # a decode step the expert backend failed is run once more (it then fetches)
SLOT_AUDIT_SAMPLE = 2    # a slot audit compares the most recently used slots whole with the expert store ...
SLOT_AUDIT_PROBES = 64   # ... and three windows of this many other slots, drawn at random
# with a decode step queued ahead (EngineConfig.overlap_decode), the expert backend's counters (a device read, which
# would wait for that step) are taken every this many decode steps, and whenever no step is in flight
COUNTERS_EVERY_OVERLAPPED = 16

log = logging.getLogger("ft.engine")

@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int = 4          # requests running together (block table rows, state cache rows)
    max_context_tokens: int | None = None  # None: min(32768, the model's context: context_tokens)
    # the paged KV cache (kv_cache.py, kv_blocks.py): positions per block, and the pool's size: kv_cache_tokens
    # (tests, benches: the full-context layers' positions) or kv_cache_gib (a memory budget for all layers);
    # neither: max_running_requests x max_context_tokens. The sliding-window layers of a model with both kinds
    # (gpt-oss) have their own pool of max_running_requests windows and one chunk (kv_cache.pool_sizes), inside
    # kv_cache_gib, beside kv_cache_tokens
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    prefix_caching: bool = True            # share full blocks of equal prefixes
    # a model with linear-attention layers (Qwen3-Next): the block-boundary states its prefix hits resume from, kept
    # for the prefix cache (state_checkpoints.py); None: max_running_requests; 0: no prefix caching for it
    state_checkpoints: int | None = None
    prefill_chunk_tokens: int | None = None  # None: the expert backend's preference, else DEFAULT_PREFILL_CHUNK_TOKENS
    cuda_graphs: bool = True               # replay decode forwards from CUDA graphs where safe
    attention_backend: str = "auto"        # decode attention: "triton" | "sdpa"; auto: triton on CUDA
    slot_audit_every: int = 0              # every N decode steps, audit the expert slot cache (0: never;
                                           # FREETOKEN_MOE_SLOT_AUDIT; docs/slot_cache.md)
    # queue the next decode step (fed with this one's sampled ids on the device) before reading this one's ids
    # back, so that the GPU does not idle while the host finishes the step (a request that stops with a step queued
    # leaves its neighbours' next token computed in the larger batch: bf16 may round it differently than the smaller
    # batch would, as when any request joins or leaves a batch); None: on CUDA (the CLIs pass --overlap-decode /
    # FREETOKEN_OVERLAP_DECODE; gpu_worker/engine/README.md)
    overlap_decode: bool | None = None

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
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size={self.kv_block_size} must be >= 1")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError(f"state_checkpoints={self.state_checkpoints} must be >= 0 (0: no prefix caching for "
                             f"a model with linear-attention layers)")
        if self.kv_cache_tokens is not None and self.kv_cache_gib is not None:
            raise ValueError("set kv_cache_tokens or kv_cache_gib, not both")
        if (self.kv_cache_tokens is not None and self.kv_cache_tokens < 1) or \
                (self.kv_cache_gib is not None and not self.kv_cache_gib > 0):
            raise ValueError(f"the KV cache size must be > 0, got kv_cache_tokens={self.kv_cache_tokens}, "
                             f"kv_cache_gib={self.kv_cache_gib}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")


@dataclass
class _DecodeStep:
    """A decode step launched: its batch, its sampled ids (and logprobs) on the device and (CUDA) their pinned host
    copies, which hold them once `ready` has completed."""
    reqs: list[Request]
    sampled: SampledStep
    host: torch.Tensor | None = None        # [B] int64, pinned
    lp_host: torch.Tensor | None = None     # the logprob lines, pinned
    ready: "torch.cuda.Event | None" = None

    @property
    def tokens(self) -> torch.Tensor:       # [B] int64, device
        return self.sampled.tokens

    def token_ids(self) -> list[int]:
        """The sampled ids on the host: waits for this step's sampling only, not for anything queued after it."""
        if self.ready is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host.tolist()

    def logprobs(self) -> dict[int, "TokenLogprobs"]:
        """Batch row -> the logprobs of its token, for the rows that asked (after token_ids: no further wait)."""
        if self.sampled.logprobs is None:
            return {}
        lines = self.lp_host if self.lp_host is not None else self.sampled.logprobs
        return self.sampled.read_logprobs(lines.tolist())


def launch_copies(sampled: SampledStep, reqs: list[Request]) -> _DecodeStep:
    """The step's host copies queued behind its sampling (CUDA; elsewhere the tensors are read in place)."""
    tokens = sampled.tokens
    if tokens.device.type != "cuda":
        return _DecodeStep(list(reqs), sampled)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    lp_host = None
    if sampled.logprobs is not None:
        lp_host = torch.empty(sampled.logprobs.shape, dtype=sampled.logprobs.dtype, pin_memory=True)
        lp_host.copy_(sampled.logprobs, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return _DecodeStep(list(reqs), sampled, host, lp_host, ready)


def context_tokens(asked: int | None, cfg) -> int:
    """The engine's longest context: `asked` (--max-context-tokens), or min(32768, the model's context). More than
    the model computes as trained (cfg.context_length: max_position_embeddings, or YaRN's original context x
    factor) is refused: the positions past it would be out of distribution and the answers quietly worse."""
    if asked is None:
        return min(DEFAULT_MAX_CONTEXT_TOKENS, cfg.context_length)
    if asked > cfg.context_length:
        yarn = "YaRN's scaled context" if cfg.rope_scaling else "max_position_embeddings"
        raise ValueError(f"max_context_tokens={asked} is longer than the model's context of {cfg.context_length} "
                         f"tokens ({yarn} in config.json); lower --max-context-tokens, or for a longer context give "
                         f"the checkpoint YaRN in config.json (Qwen3: \"rope_scaling\": {{\"rope_type\": \"yarn\", "
                         f"\"factor\": 4.0, \"original_max_position_embeddings\": 32768}})")
    return int(asked)


class Engine:
    def __init__(self, model: MoeModel, config: EngineConfig | None = None,
                 eos_token_ids: Iterable[int] | None = None, grammars: GrammarCompiler | None = None):
        self.model, self.config = model, config or EngineConfig()
        cfg = model.cfg
        self.max_context_tokens = context_tokens(self.config.max_context_tokens, cfg)
        model.ensure_positions(self.max_context_tokens)
        self._audit_skip_logged = False
        self.device = model.device
        self.eos_token_ids = frozenset(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.stats = EngineStats()
        self.prefill_chunk_tokens = (self.config.prefill_chunk_tokens
                                     or model.experts.preferred_prefill_chunk_tokens()
                                     or DEFAULT_PREFILL_CHUNK_TOKENS)
        # the full-context layers' pool, and the sliding-window layers' (gpt-oss) where the model has both
        full_blocks, window_blocks = pool_sizes(
            cfg, model.dtype, self.config.kv_block_size, self.config.max_running_requests, self.max_context_tokens,
            self.prefill_chunk_tokens, self.config.kv_cache_tokens, self.config.kv_cache_gib)
        self.kv = KVCache(cfg, self.config.max_running_requests, self.max_context_tokens, model.dtype,
                          self.device, block_size=self.config.kv_block_size, num_blocks=full_blocks,
                          window_num_blocks=window_blocks or None)
        # the linear-attention layers' per-request state (qwen3_next), in the rows of the KV cache's requests, and
        # their states at block boundaries for the prefix cache's hits (state_checkpoints.py)
        self.states = (StateCache(cfg, self.config.max_running_requests, model.dtype, self.device)
                       if cfg.linear_attention is not None else None)
        keep = self.config.state_checkpoints
        keep = self.config.max_running_requests if keep is None else keep
        prefix = self.config.prefix_caching and (self.states is None or keep > 0)
        self.checkpoints = (StateCheckpoints(self.states, keep, self.config.kv_block_size)
                            if self.states is not None and prefix else None)
        self.blocks = KVBlocks(self.kv, prefix, self.stats, self.prefill_chunk_tokens, self.checkpoints)
        self.scheduler = Scheduler(self.config.max_running_requests, self.prefill_chunk_tokens, self.blocks)
        self._ids = itertools.count()
        overlap = self.config.overlap_decode
        self.overlap_decode = self.device.type == "cuda" if overlap is None else bool(overlap)
        self._ahead: _DecodeStep | None = None      # the decode step queued ahead (overlap_decode), not yet read
        self.grammars = grammars                    # structured output (None: the model has no tokenizer.json)
        self._masks: GrammarMasks | None = None     # the constrained rows' bitmask buffers, on first use
        self.graphs = None
        if self.config.cuda_graphs and self.device.type == "cuda":
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
        self.blocks.check_fits(len(prompt_ids), params.max_new_tokens, self.max_context_tokens)
        if request_id is None:
            request_id = next(self._ids)
            while self.scheduler.find(request_id) is not None:   # a caller used this int already
                request_id = next(self._ids)
        elif self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = None
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer.json, which this model has not")
            grammar = self.grammars.matcher(params.grammar)         # GrammarError is a ValueError
            if self._masks is None:
                self._masks = GrammarMasks(self.config.max_running_requests, self.model.cfg.vocab_size,
                                           self.device)
        self.scheduler.add(Request(request_id, prompt_ids, params, RequestSampler(params, self.device, grammar),
                                   self.eos_token_ids, self.max_context_tokens))
        self.stats.requests_added += 1
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Drop a waiting or running request and free its KV blocks; False if it is unknown or done."""
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        req.finish_reason = FINISH_ABORT
        self._release(req)
        self.stats.requests_aborted += 1
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one decode forward and/or one prefill chunk; return the tokens they made.

        With overlap_decode, a decode step may already be on the GPU (queued by the previous call for the same
        requests): this call reads its tokens. If the batch has changed since (a request finished, was aborted or
        joins), that step's tokens are taken first for the requests still running, then this call plans anew."""
        outputs = self._take_stale_ahead()
        plan = self.scheduler.plan()
        if not plan.empty:
            self.stats.num_steps += 1
            made: list[StepOutput] = []
            if plan.decode:
                made += self._decode(plan.decode)
            if plan.prefill is not None:
                made += self._prefill(plan.prefill)
            outputs += self._retire(made)
        # a request of the queued step just ended (a stop token) or none is left: take it now, so that an idle
        # engine holds no step in flight and its stats and counters are whole
        outputs += self._take_stale_ahead()
        if self._ahead is None or self.stats.num_decode_steps % COUNTERS_EVERY_OVERLAPPED == 0:
            # offload / cpu / hybrid: stats, metrics, the tuner (resident: none)
            self.stats.absorb_expert_counters(self.model.experts.counters())
        return outputs

    def _retire(self, outputs: list[StepOutput]) -> list[StepOutput]:
        for out in outputs:
            if out.finished:
                self._release(self.scheduler.find(out.request_id))
                self.stats.requests_finished += 1
        self.stats.generated_tokens += len(outputs)
        return outputs

    def _release(self, req: Request) -> None:
        """Take a finished or aborted request out; its KV blocks and state rows go back (states zeroed)."""
        if self.states is not None and req.slot is not None:
            self.states.reset(req.slot)
        self.scheduler.remove(req)

    def _take_stale_ahead(self) -> list[StepOutput]:
        """The tokens of the decode step queued ahead if the next plan will not decode exactly its batch (a request
        of it ended or was aborted, one joins or prefills), retired; [] otherwise."""
        ahead = self._ahead
        if ahead is None or self.scheduler.next_decode_only() == ahead.reqs:
            return []
        self._ahead = None
        return self._retire(self._read_step(ahead))

    def _read_step(self, step: _DecodeStep, t0: float | None = None) -> list[StepOutput]:
        """A launched decode step's tokens, appended to its requests still running (one that finished or was aborted
        since it was queued made its token for nothing: its KV blocks were freed, and anything later runs after it);
        the stats, and the slot audit when due. `t0`: when the host began the step (its decode time)."""
        token_ids = step.token_ids()                                                 # host sync (this step's)
        logprobs = step.logprobs()
        now = time.perf_counter()
        self.stats.num_decode_steps += 1
        outputs = [r.append_token(t, now, logprobs.get(i)) for i, (r, t) in enumerate(zip(step.reqs, token_ids))
                   if not r.finished and r.slot is not None]
        self.stats.decode_tokens += len(outputs)
        self.stats.decode_tokens_discarded += len(step.reqs) - len(outputs)
        if t0 is not None:
            self.stats.decode_time_s += now - t0
        every = self.config.slot_audit_every
        if every and self.stats.num_decode_steps % every == 0:
            self._audit_slots(self.model.experts)
        return outputs

    def set_policy(self, **fields) -> None:
        """The coordinator's fetch policy (strategy, fetch_fraction, fetch_round, cpu_shares), passed
        to the expert backend (cpu / hybrid take one; the others have nothing to set)."""
        self.model.experts.set_policy(**fields)

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
        token_ids = torch.tensor(req.sequence_ids(start, n), dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + n, dtype=torch.int64, device=self.device)
        attn = PrefillAttention(self.kv, req.slot, start, n, self.model.cfg.sliding_window)
        if self.states is not None:
            attn = StatefulContext(attn, self.states.prefill(req.slot, start))
        rows = torch.tensor([n - 1] if chunk.is_last else [], dtype=torch.int64, device=self.device)
        logits = self.model.forward(token_ids, positions, attn, logit_rows=rows)      # [0 or 1, V]
        req.num_prefilled += n
        if self.checkpoints is not None and (start + n) % self.kv.block_size == 0:
            self.checkpoints.mark([req.slot], [start + n])                             # a block boundary
        outputs = []
        if chunk.is_last:
            sampled = launch_copies(sample_step([req.sampler], logits, self._masks), [req])
            token, logprobs = sampled.token_ids()[0], sampled.logprobs()             # host sync
            outputs.append(req.append_token(token, time.perf_counter(), logprobs.get(0)))
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)                                       # honest timing
        self.stats.num_prefill_chunks += 1
        self.stats.prefill_tokens += n
        self.stats.prefill_time_s += time.perf_counter() - t0
        return outputs

    def decode_inputs(self, reqs: list[Request], after: torch.Tensor | None = None) -> DecodeInputs:
        """The next decode step's inputs; `after`: the ids [T] (device) sampled by a step launched for the same
        requests whose tokens the host has not read yet: the inputs of the step after that one."""
        ahead = 0 if after is None else 1
        rows = [[r.seq_len - 1 + ahead for r in reqs], [r.slot for r in reqs]]
        if after is None:
            rows.insert(0, [r.output_ids[-1] for r in reqs])
        host = torch.tensor(rows, dtype=torch.int64)                                  # [3 or 2, T]
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        max_len = max(r.seq_len for r in reqs) + ahead
        return DecodeInputs(dev[0] if after is None else after, dev[-2], dev[-1],
                            bucket_tokens=decode_bucket_tokens(max_len, self.max_context_tokens))

    def decode_forward(self, inputs: DecodeInputs) -> torch.Tensor:
        """One token per request -> logits [T, V] fp32. Fixed shapes for (T, bucket); no host sync
        unless the expert backend makes one."""
        return decode_forward(self.model, self.kv, self.states, inputs, self.config.attention_backend)

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        t0 = time.perf_counter()
        current, self._ahead = self._ahead, None
        if current is not None and current.reqs != reqs:    # step() takes a step queued for another batch first
            raise RuntimeError("a decode step queued ahead for another batch was not taken first")
        if current is None:
            current = self._launch_decode(reqs, self.decode_inputs(reqs))
        if self._may_queue_next(reqs):
            self._ahead = self._launch_decode(reqs, self.decode_inputs(reqs, after=current.tokens), ahead=1)
            self.stats.decode_steps_ahead += 1
        try:
            return self._read_step(current, t0)
        except BaseException:
            # this step's tokens are lost: a step queued after it, fed with them, must not pass for the next one
            self._ahead = None
            raise

    def _may_queue_next(self, reqs: list[Request]) -> bool:
        """Whether to queue the step after this one before reading this one's tokens (overlap_decode): the same
        requests will decode next and nothing else will run (no admission, no prefill), none of them ends by length
        with this step's token, the backend's steps may overlap (`decode_steps_may_overlap`: not the hybrid backend,
        whose step hooks sync), and no slot audit falls on this step (it reads the cache with nothing in flight). A
        request that ends on a stop token makes its next token for nothing."""
        if not self.overlap_decode or self.scheduler.next_decode_only() != reqs:
            return False
        every = self.config.slot_audit_every
        if every and (self.stats.num_decode_steps + 1) % every == 0:
            return False
        if not self.model.experts.decode_steps_may_overlap():
            return False
        if any(r.sampler.grammar is not None for r in reqs):    # the next mask needs this step's tokens
            return False
        return all(len(r.output_ids) + 1 < r.params.max_new_tokens and r.seq_len + 1 <= r.max_context_tokens
                   for r in reqs)

    def _launch_decode(self, reqs: list[Request], inputs: DecodeInputs, ahead: int = 0) -> _DecodeStep:
        """Queue one decode forward and its sampling; the ids (and logprobs) stay on the device (and are copied to
        pinned host memory behind them) until `_DecodeStep.token_ids` reads them. `ahead`: 1 for the step queued
        after one whose tokens the host has not read (each request's position one further)."""
        experts = self.model.experts
        # a retried step must start from the same linear-layer states (their update is not idempotent): copied
        # where the backend's step may fail (the hybrid's device hand-off), not in every step of the others
        saved = (self.states.snapshot(inputs.slot_ids) if self.states is not None and experts.step_may_fail()
                 else None)
        for attempt in range(DECODE_ATTEMPTS):
            if attempt and self.states is not None:
                if saved is None:
                    raise RuntimeError("the expert backend failed a decode step although its step_may_fail() said "
                                       "it could not, so the linear layers' states were not kept for the re-run")
                self.states.restore(inputs.slot_ids, saved)
            experts.step_begin()
            if self.graphs is not None and self.graphs.usable(len(reqs)):
                logits = self.graphs.run(inputs)
            else:
                logits = self.decode_forward(inputs)
            # A backend whose step can fail inside a graph (the device hand-off) says so here; it has then
            # switched to fetching, and the step runs again (it rewrites the same K/V rows).
            if experts.step_end():
                break
            self.stats.decode_step_retries += 1
        else:
            raise RuntimeError(f"the expert backend failed the decode step {DECODE_ATTEMPTS} times (its re-run "
                               "fetches every miss and should not fail); see the log for the cause")
        if self.checkpoints is not None:              # requests whose step wrote a block's last position
            bs = self.kv.block_size
            ends = [(r.slot, r.seq_len + ahead) for r in reqs if (r.seq_len + ahead) % bs == 0]
            self.checkpoints.mark([s for s, _ in ends], [b for _, b in ends])
        # the grammar masks (computed on the host while the GPU runs the forward), the tokens, the logprobs
        return launch_copies(sample_step([r.sampler for r in reqs], logits, self._masks), reqs)

    def _audit_slots(self, experts) -> None:
        """The slot audit (EngineConfig.slot_audit_every): check the backend's slot cache on the host, and on a
        problem log it, count it and empty the cache, so later steps fetch every expert again instead of
        computing with a slot that does not hold its expert. The step just sampled used the cache as it was."""
        if not experts.has_slot_cache:                     # resident, cpu
            if not self._audit_skip_logged:
                self._audit_skip_logged = True
                log.info("slot audit: the %s backend has no slot cache to audit", type(experts).__name__)
            return
        self.stats.slot_audits += 1
        try:
            problems = experts.audit_slots(SLOT_AUDIT_SAMPLE, SLOT_AUDIT_PROBES, seed=self.stats.num_decode_steps)
        except Exception:                                   # a check must not lose the step's tokens
            self.stats.slot_audit_failures += 1
            log.exception("slot cache audit after decode step %d could not run", self.stats.num_decode_steps)
            return
        if problems:
            self.stats.slot_audit_failures += 1
            log.error("slot cache audit after decode step %d found: %s; emptying the cache (later steps fetch "
                      "again)", self.stats.num_decode_steps, "; ".join(problems))
            experts.reset_slots()
