"""What the backends with a GPU slot pool fed from the host expert store share (`offload`, `hybrid`): the pool's
size from --moe-cache-size, the eviction settings, the prefill prefetch's rule, and `SlotPool`, the object each of
them owns for its slot cache and pool (the lookahead prefetch and verifier over them, the prefill prefetch's pending
events, the slot audit, and emptying the cache after a call that raised)."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ftexpert.kernels.slot_cache import SlotCache, reset
from ftexpert.kernels.slot_cache.audit import audit
from ftexpert.proto.knobs import KNOBS_BY_FIELD

from ftexpert.gpu_worker.backends.offload.prefetch import (COUNTERS, STEP_COUNTERS, Lookahead, PrefetchSettings,
                                                             Predictor)
from ftexpert.gpu_worker.backends.offload.verify import SlotVerifier

log = logging.getLogger(__name__)


def resolve_cache_slots(cache_size: float | int | str | None, num_layers: int, num_experts: int,
                        per_layer: bool = False) -> int:
    """Slots per pool from --moe-cache-size: an int (slots) or a fraction in (0, 1] of all experts."""
    total = num_layers * num_experts
    if cache_size is None:
        cache_size = 0.25
    if isinstance(cache_size, str):
        cache_size = float(cache_size) if "." in cache_size else int(cache_size)
    if isinstance(cache_size, float):
        if not 0.0 < cache_size <= 1.0:
            raise ValueError(f"--moe-cache-size {cache_size} as a fraction must be in (0, 1]; or "
                             f"give a slot count")
        slots = max(1, round(cache_size * total))
    else:
        slots = int(cache_size)
    if per_layer:
        slots = slots // num_layers
    need = num_experts
    if slots < need:
        where = "per layer" if per_layer else "in the pool"
        raise ValueError(f"--moe-cache-size gives {slots} slots {where}, but one prefill call can "
                         f"route all {need} experts of a layer: give at least {need} slots"
                         f"{' per layer' if per_layer else ''} (of {total} experts in all)")
    return slots


def prefill_prefetch_layer(layer_idx: int, num_pairs: int, num_experts: int, num_layers: int,
                           gather_max_pairs: int) -> int | None:
    """The layer whose experts a call streams behind its own with the prefill prefetch: the next one, when the call
    routes at least num_experts pairs and is not decode-sized (a prefill chunk, which routes to most experts)."""
    prefill = num_pairs >= num_experts and num_pairs > gather_max_pairs
    return layer_idx + 1 if prefill and layer_idx + 1 < num_layers else None


def eviction_settings(freq_weight: int | None, freq_half_life: int | None) -> dict:
    """SlotCache.create's eviction arguments: those given, else the knobs' defaults (the CLIs resolve
    --eviction-freq-weight / FREETOKEN_EVICTION_FREQ_WEIGHT and the half-life, and pass them down)."""
    return dict(freq_weight=KNOBS_BY_FIELD["eviction_freq_weight"].default if freq_weight is None else freq_weight,
                freq_half_life=(KNOBS_BY_FIELD["eviction_freq_half_life"].default if freq_half_life is None
                                else freq_half_life))


class SlotPool:
    """A backend's slot cache `cache`, its pool `slots` [S, N] (a backend may keep rows of its own past the cache's
    S_total: the hybrid split slot) and the host rows `host_layers[l]` [E, N] they are filled from, with what acts
    on them besides the backend's own forward:
    - the lookahead prefetch (`set_prefetch`, prefetch.py) and the slot verifier (verify.py);
    - `prefetched`: layer -> the event its prefill-prefetched experts land on (None: landed already), which the
      backend's forward of that layer pops and waits for;
    - `audit` and `reset` (ExpertBackend's audit_slots / reset_slots);
    - `forget_after_error`: the cache emptied after a layer call that raised.
    copy_stream: the backend's copy stream (CUDA; None on a CPU); extra_streams: its other side streams (CUDA),
    which `side_streams` lists after the copy stream."""

    def __init__(self, cache: SlotCache, slots: torch.Tensor, host_layers, device: torch.device,
                 copy_stream: "torch.cuda.Stream | None", extra_streams: tuple = ()):
        self.cache, self.slots, self.host_layers = cache, slots, host_layers
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.copy_stream, self.extra_streams = copy_stream, tuple(extra_streams)
        self.lookahead: Lookahead | None = None      # the lookahead prefetch (set_prefetch)
        self.verifier: SlotVerifier | None = None    # FREETOKEN_MOE_PREFETCH_VERIFY (None: off)
        self.prefetched: dict[int, torch.cuda.Event | None] = {}

    def set_prefetch(self, settings: PrefetchSettings, predictor: Predictor | None,
                     saved_share: Callable[[], float] | None = None) -> None:
        """The lookahead prefetch (docs/PREFETCH.md): `settings` (mode off | measure | on | auto, budget, K, verify),
        the predictor of the next layer's experts (the model's routers: RouterPredictor) and, for auto, the share
        of a miss's cost a right guess saves (None: all of it, as in offload; Lookahead)."""
        self.lookahead = Lookahead(self.cache, self.slots, self.host_layers, self.copy_stream, settings, predictor,
                                   saved_share=saved_share)
        self.verifier = (None if settings.verify == "off" else
                         SlotVerifier(settings.verify, self.cache, self.slots, self.host_layers))

    def verify(self, layer_idx: int, ids: torch.Tensor, slot_ids: torch.Tensor, after: bool = False) -> None:
        """FREETOKEN_MOE_PREFETCH_VERIFY's check of a decode-sized call's routed slots (verify.py); nothing when
        off."""
        if self.verifier is not None:
            self.verifier.check(layer_idx, ids, slot_ids, after=after)

    def after_ensure(self, layer_idx: int) -> bool:
        """Right after a layer's ensure: wait for its lookahead prefetch copy, install the next layer's. True when a
        prefetch plan for layer + 1 was written (mode on, auto). The host path's order: its readback reads the plan."""
        self.wait_prefetch(layer_idx)
        return self.install_prefetch(layer_idx)

    def wait_prefetch(self, layer_idx: int) -> None:
        """Right after a layer's ensure: the lookahead's probe mark, and the compute stream waits for the layer's
        prefetch copy."""
        if self.lookahead is not None:
            self.lookahead.wait(layer_idx)

    def install_prefetch(self, layer_idx: int) -> bool:
        """After `wait_prefetch` and before the next layer's ensure, on the compute stream: the layer's prediction
        scored, the next layer's installed. The device paths call it once the layer's demand copy is launched (the
        decode copy's after_fork), where the compute stream would wait for that copy anyway, so the wait for the
        predictor and the install stay off the step's critical path. True when a prefetch plan was written."""
        return self.lookahead.install(layer_idx) if self.lookahead is not None else False

    def step_begin(self) -> None:
        """Before a decode step: the lookahead's measurements read and its per-layer counts updated."""
        if self.lookahead is not None:
            self.lookahead.step_begin()

    def step_end(self) -> None:
        if self.lookahead is not None:
            self.lookahead.step_end()

    def prefetch_counters(self) -> dict[str, int]:
        """The prefetch's counters (prefetch.COUNTERS; zeros without a lookahead)."""
        if self.lookahead is None:
            return dict.fromkeys(COUNTERS + STEP_COUNTERS, 0)
        return self.lookahead.counters()

    def prefetch_policy(self, fields: dict) -> None:
        """The SetPolicy fields `prefetch` (mode) and `prefetch_budget` (0: unchanged), taken out of `fields`."""
        mode, budget = fields.pop("prefetch", None), fields.pop("prefetch_budget", None)
        if (mode or budget) and self.lookahead is None:
            raise ValueError("this backend was built without a prefetch predictor; set_prefetch first")
        if mode or budget:
            self.lookahead.set_policy(mode or None, budget or None)

    def audit(self, sample_slots: int = 0, probe_slots: int = 0, seed: int = 0) -> list[str]:
        """ftexpert.kernels.slot_cache.audit over the cache and pool: the problems found (empty: none)."""
        # the cache's slots only: a backend may keep rows of its own past them (the hybrid split slot)
        return audit(self.cache, slots=self.slots[:self.cache.total_slots], host_layers=self.host_layers,
                     sample_slots=sample_slots, probe_slots=probe_slots, seed=seed)

    def reset(self) -> None:
        """Empty the slot cache in place (the pool's bytes stay, unmapped): later calls fetch again."""
        reset(self.cache)

    def side_streams(self) -> list:
        """The CUDA streams besides the compute stream that the backend's copies (or hand-offs) run on: the copy
        stream, the extra streams, the lookahead's predictor stream."""
        streams = [self.copy_stream, *self.extra_streams] if self.on_cuda else []
        if self.on_cuda and self.lookahead is not None:
            streams.append(self.lookahead.predict_stream)
        return streams

    def forget_after_error(self, exc: BaseException, stats) -> None:
        """A call that raised after its `ensure` (or `prefetch_ensure`) may leave slots mapped whose copies never ran;
        a later call would read them as hits and compute with the bytes of whatever expert was there before. So
        the cache is emptied (later calls fetch again: slower for a while, never wrong) and the next layers' pending
        prefetch events forgotten; `stats.resets_after_error` counts it. Nothing to undo while a CUDA graph is being
        captured (nothing ran); a reset that fails too (a broken device context) is logged, and the call's own error
        is what propagates."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        try:
            if self.device.type == "cuda":
                # copies still in flight on the side streams (a prefill's prefetch, whose event is forgotten below)
                # must land before anything later can map and fill those slots from the compute stream
                compute = torch.cuda.current_stream(self.device)
                for stream in self.side_streams():
                    compute.wait_stream(stream)
            reset(self.cache)
            self.prefetched.clear()
            if self.lookahead is not None:
                self.lookahead.join()
            stats.resets_after_error += 1
            log.warning("an expert call failed (%s: %s); the slot cache was emptied so that no slot mapped by it is "
                        "read before its copy lands", type(exc).__name__, exc)
        except Exception:                           # noqa: BLE001 - the original error is the one to report
            log.exception("emptying the slot cache after a failed expert call failed too")
