"""Lookahead expert prefetch (docs/PREFETCH.md): while layer L-1 computes, predict layer L's routed experts and
copy them into low-priority slots, so that fewer of layer L's experts are misses when its router runs.

Per decode-sized layer call of a backend with a slot cache (`offload`, `hybrid`), `Lookahead` does, in order:
  1. `begin(L-1, h, ids)` at the start of layer L-1's MoE block: scores layer L-1's own prediction (made at L-2)
     against its routes (device counters), then forks the predictor: layer L's router applied to h, layer L-1's
     router input (`RouterPredictor`), top-K candidates. On CUDA on a predictor stream forked from the compute
     stream; it reads no cache state. On the CPU the same maths in program order.
  2. `install(L-1)` right after ensure(L-1), on the compute stream: waits for the predictor, then
     `prefetch_ensure(L, candidates, budget)` installs the first `budget` non-resident candidates as usage-0 slots
     (the next victims when wrong; never a slot used at this step) and writes the prefetch plan. `measure` picks
     the same experts without installing anything.
  3. `copy(L-1)` after layer L-1's demand copy was queued: the prefetch plan copied on the copy stream (the device
     copy kernel, no host sync: graph-capturable), behind that demand copy. On the CPU, at once.
  4. `wait(L)` right after ensure(L): the compute stream waits for the prefetch copy before layer L's GEMMs, its
     demand copy and the next `prefetch_ensure` (which rewrites the plan the copy reads).
Every slot-map write (the slot cache's kernels) stays on the compute stream in program order; the predictor and
copy streams only read maps and copy bytes (tests/gpu_worker/test_prefetch_structure.py checks it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from ftexpert.kernels.expert_copy import copy_plan
from ftexpert.kernels.slot_cache import prefetch_ensure
from ftexpert.kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES

PREFETCH_MODES = ("off", "measure", "on")
VERIFY_MODES = ("off", "meta", "1")
# device counters: [predicted, useful, installed, routed distinct of predicted layers]
COUNTERS = ("prefetch_predicted_total", "prefetch_useful_total", "prefetch_installed_total",
            "prefetch_layer_calls_total")


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


def settings_from_knobs(values: dict) -> PrefetchSettings | None:
    """PrefetchSettings from resolved knob values (proto.knobs.resolve over PREFETCH_KNOBS); None when the prefetch
    and its verifier are both off (nothing is built)."""
    settings = PrefetchSettings(mode=values["moe_prefetch"], budget=values["moe_prefetch_budget"],
                                k=values["moe_prefetch_k"], verify=values["moe_prefetch_verify"])
    return None if settings.mode == "off" and settings.verify == "off" else settings


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
    its host rows, `copy_stream` the backend's copy stream (CUDA; None on the CPU)."""

    def __init__(self, cache, slots: torch.Tensor, host_layers, copy_stream, settings: PrefetchSettings,
                 predictor: Predictor | None):
        if settings.mode != "off" and predictor is None:
            raise ValueError(f"prefetch mode {settings.mode!r} needs a predictor (the model's routers)")
        self.cache, self.slots, self.host_layers = cache, slots, host_layers
        self.settings, self.predictor = settings, predictor
        self.device = slots.device
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = copy_stream
        self.predict_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.counts = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        self._chosen = torch.full((MAX_PREFETCH_CANDIDATES,), -1, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(MAX_PREFETCH_CANDIDATES, device=self.device)
        self._cand: torch.Tensor | None = None      # the pending prediction (for layer _target)
        self._predicted: "torch.cuda.Event | None" = None
        self._target = -1                           # the layer the pending prediction is for
        self._scored_layer = -1                     # the layer `_chosen` holds experts of
        self._copied: "torch.cuda.Event | None" = None    # the prefetch copy of layer _copied_layer
        self._copied_layer = -1
        self._copy_after: "torch.cuda.Event | None" = None
        self._installed = False

    @property
    def mode(self) -> str:
        return self.settings.mode

    def graph_key(self) -> tuple:
        s = self.settings
        return (s.mode, s.budget, s.k) if s.mode != "off" else ("off",)

    def set_policy(self, mode: str | None = None, budget: int | None = None) -> None:
        settings = self.settings.with_policy(mode, budget)
        if settings.mode != "off" and self.predictor is None:
            raise ValueError(f"prefetch mode {settings.mode!r} needs a predictor (the model's routers)")
        self.settings = settings

    def set_predictor(self, predictor: Predictor | None) -> None:
        self.predictor = predictor

    def _compute(self):
        return torch.cuda.current_stream(self.device) if self.on_cuda else None

    # -- the steps, in a layer call's order ---------------------------------------------------------
    def begin(self, layer: int, h: torch.Tensor, ids: torch.Tensor, decode_sized: bool) -> None:
        """Start of layer `layer`'s MoE block: score its prediction, fork the next layer's."""
        self._installed = False
        if self.mode == "off":
            return
        if layer == 0 or not decode_sized:
            self._target = self._scored_layer = -1      # a new forward, or a prefill call: nothing pending
        if self._scored_layer == layer:
            chosen = self._chosen
            valid = chosen >= 0
            hit = (chosen[:, None] == ids.reshape(1, -1)).any(1) & valid
            self.counts[0] += valid.sum()
            self.counts[1] += hit.sum()
            self.counts[3] += 1
        self._scored_layer = -1
        self._target, self._cand = -1, None
        nxt = layer + 1
        if not decode_sized or nxt >= self.cache.num_layers:
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
        """Right after ensure(layer): the compute stream waits for the prefetch copy made for `layer`."""
        if self._copied is not None and self._copied_layer == layer and self.on_cuda:
            self._compute().wait_event(self._copied)
        self._copied, self._copied_layer = None, -1

    def install(self, layer: int) -> bool:
        """Right after ensure(layer) (and `wait`): the next layer's prefetch install (or, measuring, its
        choice). True when a prefetch plan was written (mode on)."""
        nxt = self._target
        if nxt != layer + 1 or self._cand is None or self._installed:
            return False
        self._installed = True
        cand, budget = self._cand, self.settings.budget
        if self.on_cuda:
            self._compute().wait_event(self._predicted)
        c = self.cache
        if self.mode == "on":
            prefetch_ensure(c, nxt, cand, budget, check_ids=False)
            n = c.prefetch_num_indices.to(torch.int64)
            src = c.prefetch_src_indices[:budget].to(torch.int64)
            chosen = torch.where(self._arange[:budget] < n, src, -1)
            self.counts[2] += n[0]
            if self.on_cuda:
                self._copy_after = torch.cuda.Event()
                self._copy_after.record(self._compute())
        else:                                            # measure: the same choice, nothing installed
            chosen = self._dry_choice(nxt, cand, budget)
        self._chosen[:budget].copy_(chosen)
        self._chosen[budget:].fill_(-1)
        self._scored_layer = nxt
        return self.mode == "on"

    def _dry_choice(self, layer: int, cand: torch.Tensor, budget: int) -> torch.Tensor:
        """prefetch_ensure's choice without installing: the first `budget` distinct valid non-resident candidates
        (reads the maps on the compute stream)."""
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
        return out[:budget]      # (index `budget` collects the unpicked: dropped)

    def copy(self, layer: int) -> None:
        """After layer `layer`'s demand copy was queued: the prefetch plan of layer + 1 (mode on)."""
        if self.mode != "on" or not self._installed or self._target != layer + 1:
            return
        c, nxt, budget = self.cache, layer + 1, self.settings.budget
        host_layer = self.host_layers[nxt]
        if not self.on_cuda:
            copy_plan(self.slots, host_layer, c.prefetch_evict_slots, c.prefetch_src_indices,
                      c.prefetch_num_indices, max_copies=budget)
            return
        side = self.copy_stream
        side.wait_event(self._copy_after)    # behind the install (and every GEMM queued before it)
        with torch.cuda.stream(side):
            copy_plan(self.slots, host_layer, c.prefetch_evict_slots, c.prefetch_src_indices,
                      c.prefetch_num_indices, max_copies=budget)
            self._copied = torch.cuda.Event()
            self._copied.record(side)
        self._copied_layer = nxt

    def join(self) -> None:
        """Join every side stream into the compute stream (after a call that raised, before a capture ends)."""
        if self.on_cuda:
            compute = self._compute()
            compute.wait_stream(self.predict_stream)
            compute.wait_stream(self.copy_stream)
        self._target, self._cand, self._copied, self._copied_layer = -1, None, None, -1

    def counters(self) -> dict[str, int]:
        """The device counters (one small read): predictions scored, useful ones (installed, or measured, then
        routed), experts installed, layer calls scored."""
        return dict(zip(COUNTERS, (int(v) for v in self.counts.tolist())))


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
