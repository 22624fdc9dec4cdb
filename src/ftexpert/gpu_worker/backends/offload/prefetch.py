"""Lookahead expert prefetch (docs/PREFETCH.md): while layer L-1 computes, predict layer L's routed experts and
copy them into low-priority slots, so that fewer of layer L's experts are misses when its router runs.

Per decode-sized layer call of a backend with a slot cache (`offload`, `hybrid`), `Lookahead` does, in order:
  1. `begin(L-1, h, ids)` at the start of layer L-1's MoE block: keeps layer L-1's routes for the score of its own
     prediction (made at L-2), then forks the predictor: layer L's router applied to h, layer L-1's router input
     (`RouterPredictor`), top-K candidates. On CUDA on a predictor stream forked from the compute stream; it reads
     no cache state. On the CPU the same maths in program order.
  2. `wait(L-1)` right after ensure(L-1): the probe's mark, and the compute stream waits for L-1's prefetch copy.
  3. `install(L-1)` on the compute stream, where the device paths launch it: right after layer L-1's demand copy
     was launched (the decode copy's after_fork), while the compute stream would wait for that copy anyway, so the
     wait for the predictor and these two launches stay off the step's critical path (the host path: right after
     `wait`, before its readback). First the kept score (`prefetch_score`: one launch updating the device counters
     and auto's per-rank counts, reading L-1's plan before it is rewritten), then `prefetch_ensure(L, candidates,
     budget)` installs the first `budget` non-resident candidates as usage-0 slots (the next victims when wrong;
     never a slot used at this step) and writes the prefetch plan. `measure` picks the same experts without
     installing anything. `auto` installs at most the rule's count for L, a device tensor the kernel reads
     (`allow`), and has every candidate's rank among the non-resident ones written.
  4. `copy(L-1)` after layer L-1's demand copy was queued: the prefetch plan copied on the copy stream (the device
     copy kernel, no host sync: graph-capturable), behind that demand copy and the install. On the CPU, at once.
`auto` (docs/PREFETCH.md "auto"): between decode steps `step_begin` reads the link probe (prefetch_probe.py: CUDA
events in one decode step in 16, read when complete, no host sync) and the per-rank precision counts, updates the
rule's estimates (prefetch_budget.py) and writes the per-layer counts to `allow`; where no layer's idle window
holds half a copy it runs no predictor at all. `measure` runs the same probe and scores what auto would choose.
Every slot-map write (the slot cache's kernels) stays on the compute stream in program order; the predictor and
copy streams only read maps and copy bytes (tests/gpu_worker/test_prefetch_structure.py checks it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from ftexpert.kernels.expert_copy import copy_plan
from ftexpert.kernels.slot_cache import prefetch_ensure, prefetch_score
from ftexpert.kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES

from ftexpert.gpu_worker.backends.offload.prefetch_budget import OnlineBudget
from ftexpert.gpu_worker.backends.offload.prefetch_guard import StepGuard, StepTimer
from ftexpert.gpu_worker.backends.offload.prefetch_probe import LinkProbe

PREFETCH_MODES = ("off", "measure", "on", "auto")
VERIFY_MODES = ("off", "meta", "1")
# device counters: [predicted, useful, installed, layer calls scored, auto's choice, of it routed]
COUNTERS = ("prefetch_predicted_total", "prefetch_useful_total", "prefetch_installed_total",
            "prefetch_layer_calls_total", "prefetch_auto_predicted_total", "prefetch_auto_useful_total")
# host counters of auto: decode steps its rule would predict in, and of those the steps the guard let it
STEP_COUNTERS = ("prefetch_auto_steps_total", "prefetch_auto_predicting_steps_total")


@dataclass(frozen=True)
class PrefetchSettings:
    """FREETOKEN_MOE_PREFETCH (mode), _BUDGET (experts installed per layer), _K (candidates), _VERIFY."""
    mode: str = "off"
    budget: int = 4
    k: int = 16
    verify: str = "off"

    def __post_init__(self) -> None:
        if self.mode not in PREFETCH_MODES:
            raise ValueError(f"prefetch mode {self.mode!r}: use one of {', '.join(PREFETCH_MODES)}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"prefetch verify {self.verify!r}: use one of {', '.join(VERIFY_MODES)}")
        for name, value, hi in (("budget", self.budget, MAX_PREFETCH_CANDIDATES),
                                ("k", self.k, MAX_PREFETCH_CANDIDATES)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"prefetch {name} must be an int in [1, {hi}], got {value!r}")

    def with_policy(self, mode: str | None = None, budget: int | None = None) -> "PrefetchSettings":
        """These settings with a SetPolicy change (None: unchanged)."""
        return replace(self, mode=self.mode if mode is None else mode,
                       budget=self.budget if budget is None else int(budget))


PREFETCH_KNOBS = ("moe_prefetch", "moe_prefetch_budget", "moe_prefetch_k", "moe_prefetch_verify")


class Predictor(Protocol):
    def predict(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Ranked candidate expert ids [C] int64 (device, C <= 128, -1 = none) of `layer` from h [T, H], the
        router input of layer - 1. Graph-safe: no host sync, fixed shapes."""


class RouterPredictor:
    """Layer L's router applied to layer L-1's router input: per token the softmax over the experts, summed over
    the tokens, top-k (for one token: the router's own top-k order). `biases`: each layer's router bias (gpt-oss)
    or None."""

    def __init__(self, routers: list[torch.Tensor], k: int, biases: list[torch.Tensor | None] | None = None):
        self.routers, self.k = routers, min(k, routers[0].shape[0])
        self.biases = biases if biases is not None else [None] * len(routers)

    def predict(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.routers[layer], self.biases[layer])
        scores = torch.softmax(logits.float(), dim=-1).sum(0)                                  # [E]
        return torch.topk(scores, self.k).indices                                            # [k] int64


class RandomPredictor:
    """Garbage candidates (tests: prefetch must stay lossless whatever the predictor says): rows of a seeded random
    table ([-1, E) ids), one per call, picked by a device counter (graph-safe: a replay advances it too)."""

    ROWS = 1024

    def __init__(self, num_experts: int, k: int, seed: int = 0, device: torch.device | str = "cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randint(-1, num_experts, (self.ROWS, k), generator=gen).to(device)
        self.calls = torch.zeros(1, dtype=torch.int64, device=device)

    def predict(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        row = self.table.index_select(0, self.calls % self.ROWS)[0]
        self.calls += 1
        return row


class TracePredictor:
    """A replayed routing trace's recorded predictor candidates (gpu_worker/models/synthetic_routing.py: the
    trace's lookahead for the forward's positions) stand in for the live predictor, whose router is random."""

    def __init__(self, routing, k: int):
        if routing.candidates is None:
            raise ValueError(f"routing {routing.source} records no predictor candidates: use a trace:FILE")
        self.routing, self.k = routing, k

    def predict(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        cand = self.routing.lookahead(layer)                                             # [T, C]
        per_token = max(1, -(-self.k // cand.shape[0]))
        ranked = cand[:, :per_token].transpose(0, 1).reshape(-1)                        # rank-major
        return ranked[:MAX_PREFETCH_CANDIDATES]


class Lookahead:
    """The prefetch of one backend (see the module docstring). `slots` [S, N] the pool, `host_layers[l]` [E, N]
    its host rows, `copy_stream` the backend's copy stream (CUDA; None on the CPU); `saved_share()`: the
    share of a miss's cost a right guess takes off the step (offload 1; hybrid its fetch fraction; prefetch_budget.py)."""

    def __init__(self, cache, slots: torch.Tensor, host_layers, copy_stream, settings: PrefetchSettings,
                 predictor: Predictor | None, *, saved_share: Callable[[], float] | None = None):
        if settings.mode != "off" and predictor is None:
            raise ValueError(f"prefetch mode {settings.mode!r} needs a predictor (the model's routers)")
        self.cache, self.slots, self.host_layers = cache, slots, host_layers
        self.settings, self.predictor = settings, predictor
        self.device = slots.device
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = copy_stream
        self.saved_share = saved_share if saved_share is not None else (lambda: 1.0)
        self.predict_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.counts = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        self._chosen = torch.full((MAX_PREFETCH_CANDIDATES,), -1, dtype=torch.int64, device=self.device)  # measure
        # the scored layer's choice: (its entries: the install's plan, or measure's _chosen; how many of them; the
        # plan's count on the device, None for measure), set by `install`, read by the target's `begin`
        self._scored: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
        self._cand: torch.Tensor | None = None      # the pending prediction (for layer _target)
        self._predicted: "torch.cuda.Event | None" = None
        self._target = -1                           # the layer the pending prediction is for
        self._scored_layer = -1                     # the layer `_chosen` holds experts of
        self._copied: "torch.cuda.Event | None" = None    # the prefetch copy of layer _copied_layer
        self._copied_layer = -1
        self._copy_after: "torch.cuda.Event | None" = None
        self._installed = False
        self._decode_call = False                   # the current layer call is decode-sized
        self._marked_layer = -1                     # the layer whose ready mark the probe took (timed steps)
        self._fork_mark: "torch.cuda.Event | None" = None
        # auto (and measure's report of it): the rule, its measurements and the per-layer counts it allows
        layers, k = cache.num_layers, settings.k
        self.expert_bytes = slots.shape[1] * slots.element_size()
        self.rule = OnlineBudget(layers, k, self.expert_bytes)
        self.probe = LinkProbe(layers, self.device, self.expert_bytes)
        self.allow = torch.zeros(layers, dtype=torch.int64, device=self.device)    # installs per target layer
        self.allowed = [0] * layers                                                # its host copy
        self._allow_host = torch.zeros(layers, dtype=torch.int64, pin_memory=self.on_cuda)
        self.rule_active = False                    # auto: the rule would predict (some window holds a copy)
        self.active = False                         # auto: the predictor runs in this step (the rule and the guard)
        self.guard = StepGuard()                    # auto: predicting kept only where it makes steps faster
        self.guarded = self.on_cuda                 # the guard times GPU steps (a CPU measures no idle window, so
                                                    # auto predicts there only where a test gives the rule windows)
        self.step_timer = StepTimer(self.device)
        self.step_counts = [0, 0]                   # STEP_COUNTERS
        # [seen, routed] per target layer and rank among the non-resident candidates (column k: resident or none)
        self.rank_counts = torch.zeros(2, layers, k + 1, dtype=torch.int64, device=self.device)
        self._ranks_seen = [[0] * (k + 1) for _ in range(layers)]
        self._ranks_hit = [[0] * (k + 1) for _ in range(layers)]
        self._rank_buf = torch.full((k,), -1, dtype=torch.int64, device=self.device)
        self._tracked: torch.Tensor | None = None   # the scored layer's candidates (their ranks in _rank_buf)
        # (layer, its routes, its candidates): kept by `begin`, scored by `install` (or the next `begin`)
        self._pending_score: tuple | None = None
        self.auto_gain_s = 0.0                      # the rule's expected seconds saved per decode step
        self.recording: list[dict] | None = None    # a list: every probe sample read is appended (benchmarks)

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def probing(self) -> bool:
        """The link probe and the rank counts run (auto, and measure's report of what auto would do)."""
        return self.mode in ("auto", "measure")

    def graph_key(self) -> tuple:
        s = self.settings
        if s.mode == "off":
            return ("off",)
        if s.mode == "on":
            return (s.mode, s.budget, s.k)
        return (s.mode, s.budget if s.mode == "measure" else self.active, s.k, self.probe.graph_key())

    def set_policy(self, mode: str | None = None, budget: int | None = None) -> None:
        settings = self.settings.with_policy(mode, budget)
        if settings.mode != "off" and self.predictor is None:
            raise ValueError(f"prefetch mode {settings.mode!r} needs a predictor (the model's routers)")
        if settings.mode != self.settings.mode:     # the guard keeps its decision, its pending step times dropped
            self.guard.pause()
            self.step_timer.clear()
        self.settings = settings
        self._pending_score = None          # a score kept under the old policy is dropped

    def set_predictor(self, predictor: Predictor | None) -> None:
        self.predictor = predictor

    def _compute(self):
        return torch.cuda.current_stream(self.device) if self.on_cuda else None

    @property
    def _auto_cap(self) -> int:
        """auto's most installs a layer (the kernel's budget; the per-layer count on the device cuts it)."""
        return min(self.settings.k, self.cache.num_slots)

    @property
    def plan_length(self) -> int:
        """The most entries an install's prefetch plan has (what a readback of it reads)."""
        return self._auto_cap if self.mode == "auto" else self.settings.budget

    def _predicting(self) -> bool:
        return self.mode in ("on", "measure") or (self.mode == "auto" and self.active)

    # -- between decode steps: the measurements in, the per-layer counts out ----------------------------
    def step_begin(self) -> None:
        """Before a decode step (the backend's step_begin): read what the probe measured SETS timed steps ago (no
        wait), update the rule's estimates and, when they changed, the per-layer counts on the device (a copy
        queued on the compute stream before the step) and whether the rule would predict at all; where it would,
        the guard's schedule says whether this step does, and the step's forward is timed for it."""
        sample = self.probe.begin_step([self.rank_counts])
        guarded = self.guarded and self.mode == "auto"
        if guarded:
            for (block, index, on), seconds in self.step_timer.poll():
                self.guard.observe(block, index, on, seconds)
        if sample is not None and self.probing:
            self._read_sample(sample)
        if guarded and self.rule_active:
            self.active = self.guard.next_on()      # the guard's block schedule (prefetch_guard.py)
            self.step_timer.begin(self.guard.last)
        if self.mode == "auto" and self.rule_active:
            self.step_counts[0] += 1
            self.step_counts[1] += int(self.active)

    def _read_sample(self, sample) -> None:
        """A probe sample into the rule's estimates, then the per-layer counts and the rule's predicting state."""
        if self.recording is not None:
            self.recording.append(sample_record(sample))
        rule = self.rule
        for layer, (w, j) in enumerate(zip(sample.windows, sample.joins)):
            if w is not None:
                rule.observe_window(layer, w)
            if j is not None:
                rule.observe_join(layer, j)
        rule.observe_bandwidth(sample.copy_bytes, sample.copy_s)
        if sample.snapshot:
            self._observe_ranks(sample.snapshot[0])
        self.update_allowances()

    def step_end(self) -> None:
        self.probe.end_step([self.rank_counts])
        self.step_timer.end()

    def _observe_ranks(self, counts: list) -> None:
        """Cumulative [seen, routed][layer][rank] -> the rule's per-rank precision (the counts since the last)."""
        for layer in range(self.cache.num_layers):
            seen, hit = counts[0][layer], counts[1][layer]
            d_seen = [a - b for a, b in zip(seen, self._ranks_seen[layer])]
            d_hit = [a - b for a, b in zip(hit, self._ranks_hit[layer])]
            self._ranks_seen[layer], self._ranks_hit[layer] = list(seen), list(hit)
            if any(d_seen[:self.settings.k]):
                self.rule.observe_ranks(layer, d_seen, d_hit)

    def update_allowances(self) -> None:
        """Apply the rule to the current estimates: the per-layer counts (written to the device when they
        change), auto's predicting state (some layer's window holds half a copy) and the expected gain."""
        saved = float(self.saved_share())
        cap = self._auto_cap
        allowed = self.rule.budgets(saved, cap) if saved > 0 else [0] * self.cache.num_layers
        self.rule_active = self.active = saved > 0 and self.rule.window_fits()
        self.auto_gain_s = self.rule.expected_gain_s(saved, cap) if saved > 0 else 0.0
        if allowed != self.allowed:
            self.allowed = allowed
            self._allow_host.copy_(torch.tensor(allowed, dtype=torch.int64))
            self.allow.copy_(self._allow_host, non_blocking=self.on_cuda)

    def report(self) -> dict:
        """What the rule sees and decides now (benchmarks, logs): per layer the window used (s) and the count;
        the bandwidth (bytes/s); the expected seconds saved per decode step; whether auto predicts."""
        rule = self.rule
        return {"windows_s": [rule.idle_s(layer) for layer in range(self.cache.num_layers)],
                "allowed": list(self.allowed), "bandwidth": rule.bandwidth.mean if rule.bandwidth.samples else 0.0,
                "gain_s_per_step": self.auto_gain_s, "active": self.rule_active, "guard": self.guard.report()}

    # -- the steps, in a layer call's order ---------------------------------------------------------
    def begin(self, layer: int, h: torch.Tensor, ids: torch.Tensor, decode_sized: bool) -> None:
        """Start of layer `layer`'s MoE block: keep its routes for the score of its prediction (run by `install`, or
        by the next `begin` / `join` where no install follows), fork the next layer's prediction."""
        self._installed = False
        self._decode_call = decode_sized
        if self.mode == "off":
            return
        self._flush_score()                   # a call that ran no install: its score now
        if layer == 0 or not decode_sized:
            self._target = self._scored_layer = -1      # a new forward, or a prefill call: nothing pending
        if self._scored_layer == layer:
            self._pending_score = (layer, ids.reshape(-1), self._tracked)
        self._scored_layer = -1
        self._tracked = None
        self._target, self._cand = -1, None
        nxt = layer + 1
        if not decode_sized or nxt >= self.cache.num_layers or not self._predicting():
            return
        if self.on_cuda:
            compute = self._compute()
            self.predict_stream.wait_stream(compute)
            with torch.cuda.stream(self.predict_stream):
                self._cand = self.predictor.predict(nxt, h)[:self.settings.k].contiguous()
                self._predicted = torch.cuda.Event()
                self._predicted.record(self.predict_stream)
            # (h stays alive: the layer's GEMMs read it on the compute stream, which waits for the predictor first)
        else:
            self._cand = self.predictor.predict(nxt, h)[:self.settings.k].contiguous()
        self._target = nxt

    def wait(self, layer: int) -> None:
        """Right after ensure(layer): the probe's mark (the link could take layer's demand copy from here), then
        the compute stream waits for the prefetch copy made for `layer`."""
        self._marked_layer = -1
        if self._decode_call and self.probing and self.probe.timing(layer):
            compute = self._compute()
            self.probe.ready(layer, compute, self.cache.num_indices)
            self._fork_mark = torch.cuda.Event()
            self._fork_mark.record(compute)
            self._marked_layer = layer
        if self._copied is not None and self._copied_layer == layer and self.on_cuda:
            self._compute().wait_event(self._copied)
        self._copied, self._copied_layer = None, -1

    def _flush_score(self) -> None:
        """The pending score (`begin`): one launch on the compute stream, the choice (and auto's per-rank counts)
        against the layer's routes. It reads the scored layer's plan and ranks, so it runs before the next
        install rewrites them."""
        if self._pending_score is None:
            return
        layer, routed, tracked = self._pending_score
        self._pending_score = None
        chosen, length, num = self._scored
        prefetch_score(routed, chosen, length, num, self.counts, cand=tracked, ranks=self._rank_buf,
                       k=self.settings.k, allow=self.allow[layer:layer + 1], seen=self.rank_counts[0, layer],
                       hit=self.rank_counts[1, layer], count_installed=num is not None)

    def install(self, layer: int) -> bool:
        """Right after ensure(layer) (and `wait`): the next layer's prefetch install (or, measuring, its
        choice). True when a prefetch plan was written (mode on, auto)."""
        self._flush_score()
        nxt = self._target
        if nxt != layer + 1 or self._cand is None or self._installed:
            return False
        self._installed = True
        cand, budget = self._cand, self.settings.budget
        if self.on_cuda:
            self._compute().wait_event(self._predicted)
        c = self.cache
        if self.mode in ("on", "auto"):
            if self.mode == "auto":       # at most allow[nxt] of them; every candidate's rank written for scoring
                budget = self._auto_cap
                prefetch_ensure(c, nxt, cand, budget, check_ids=False, device_budget=self.allow[nxt:nxt + 1],
                                ranks_out=self._rank_buf)
                self._tracked = cand
            else:
                prefetch_ensure(c, nxt, cand, budget, check_ids=False)
            if self.on_cuda:
                self._copy_after = torch.cuda.Event()
                self._copy_after.record(self._compute())
            plan = c.prefetch_src_indices
            self._scored = (plan, min(budget, plan.numel()), c.prefetch_num_indices)
        else:                                            # measure: the same choice, nothing installed
            chosen, fresh, rank = self._dry_choice(nxt, cand, budget)
            self._rank_buf[:cand.numel()].copy_(torch.where(fresh, rank, -1))
            self._tracked = cand
            self._chosen[:budget].copy_(chosen)
            self._scored = (self._chosen, min(budget, self._chosen.numel()), None)
        self._scored_layer = nxt
        return self.mode in ("on", "auto")

    def _dry_choice(self, layer: int, cand: torch.Tensor,
                    budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """prefetch_ensure's choice without installing: the first `budget` distinct valid non-resident candidates
        (reads the maps on the compute stream); and per candidate whether it is one of those (fresh) and its rank
        among them (0-based)."""
        c = self.cache
        n = cand.numel()
        valid = (cand >= 0) & (cand < c.num_experts)
        safe = torch.where(valid, cand, 0)
        earlier = torch.ones(n, n, dtype=torch.bool, device=cand.device).tril(-1)
        dup = ((cand[:, None] == cand[None, :]) & earlier & valid[None, :]).any(1)
        fresh = valid & ~dup & (c.slot_for_id[layer][safe] < 0)
        rank = torch.cumsum(fresh.to(torch.int64), 0)
        pick = fresh & (rank <= budget)
        out = torch.full((budget + 1,), -1, dtype=torch.int64, device=cand.device)
        out.scatter_(0, torch.where(pick, rank - 1, budget), torch.where(pick, cand, -1))
        return out[:budget], fresh, rank - 1      # (index `budget` collects the unpicked: dropped)

    def copy(self, layer: int) -> None:
        """After layer `layer`'s demand copy was queued: the prefetch plan of layer + 1 (mode on, auto), behind it
        on the copy stream; in a timed step (auto, measure) the probe's marks around it. The compute stream joins
        what this queues at ensure(layer + 1) (`wait`)."""
        c, nxt = self.cache, layer + 1
        if nxt >= c.num_layers:
            return
        probing = self._marked_layer == layer
        prefetching = self.mode in ("on", "auto") and self._installed and self._target == nxt
        if not (probing or prefetching):
            return
        cap = self.plan_length
        if not self.on_cuda:
            copy_plan(self.slots, self.host_layers[nxt], c.prefetch_evict_slots, c.prefetch_src_indices,
                      c.prefetch_num_indices, max_copies=cap)
            return
        side = self.copy_stream
        # behind the install (and every GEMM queued before it); probing alone: behind ensure(layer), which the
        # demand copy already is (this only makes the marks part of a capture)
        side.wait_event(self._copy_after if prefetching else self._fork_mark)
        if probing:
            self.probe.demand_end(layer, side)
        if prefetching:
            with torch.cuda.stream(side):
                copy_plan(self.slots, self.host_layers[nxt], c.prefetch_evict_slots, c.prefetch_src_indices,
                          c.prefetch_num_indices, max_copies=cap)
        if probing:
            self.probe.fetched_end(nxt, side, c.prefetch_num_indices if prefetching else None)
        self._copied = torch.cuda.Event()
        self._copied.record(side)
        self._copied_layer = nxt

    def join(self) -> None:
        """Join every side stream into the compute stream (after a call that raised, before a capture ends)."""
        self._pending_score = None          # a raised call's routes are not scored
        if self.on_cuda:
            compute = self._compute()
            compute.wait_stream(self.predict_stream)
            compute.wait_stream(self.copy_stream)
        self._target, self._cand, self._copied, self._copied_layer = -1, None, None, -1
        self._tracked, self._marked_layer = None, -1

    def counters(self) -> dict[str, int]:
        """The device counters (one small read): predictions scored, useful ones (installed, or measured, then
        routed), experts installed, layer calls scored; auto's choice and its useful part (auto, measure); and the
        host's STEP_COUNTERS (auto: the decode steps its rule would predict in, those the predictor ran in)."""
        return {**dict(zip(COUNTERS, (int(v) for v in self.counts.tolist()))),
                **dict(zip(STEP_COUNTERS, self.step_counts))}


def sample_record(sample) -> dict:
    """A probe sample as plain data (bench_prefetch.py --record-probe): per layer the idle window and the join wait
    (us; None: not measured), the copies' bytes and their time on the link (us), and the cumulative per-rank counts
    [seen, routed][layer][rank] (column k: resident or none) as read with it."""
    def us(v):
        return None if v is None else round(v * 1e6, 2)
    return {"windows_us": [us(w) for w in sample.windows], "joins_us": [us(j) for j in sample.joins],
            "copy_bytes": sample.copy_bytes, "copy_us": us(sample.copy_s),
            "rank_counts": sample.snapshot[0] if sample.snapshot else None}


def model_predictor(model, k: int) -> Predictor:
    """The predictor for `model`: the replayed trace's recorded candidates when the model replays a trace that has
    them (benchmarks of random-weight presets), else the model's own routers with their biases."""
    routing = model.routing_override
    if routing is not None and routing.candidates is not None:
        return TracePredictor(routing, k)
    layers = model.dense.layers
    return RouterPredictor([layer.router for layer in layers], k, [layer.router_bias for layer in layers])


def attach_prefetch(model, settings: PrefetchSettings | None, predictor: Predictor | None = None) -> None:
    """Give `model`'s expert backend the prefetch `settings` (None: off, which SetPolicy may turn on later) and a
    predictor: `predictor`, or `model_predictor(model, settings.k)`."""
    if settings is None:
        settings = PrefetchSettings()
    model.experts.set_prefetch(settings, predictor if predictor is not None else model_predictor(model, settings.k))
