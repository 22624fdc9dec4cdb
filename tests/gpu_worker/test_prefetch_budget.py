"""The `auto` prefetch's budget rule (gpu_worker/backends/offload/prefetch_budget.py, docs/PREFETCH.md "auto"): a
table of hand-computed outcomes; the online estimates against a plain reference written here, on per-layer timings in
the form the link probe gives them (data/prefetch_timings.json: the H200 figures of issue 39 as timings); the
adaptation (converging to the window's count, dropping to 0 when the link saturates); and the Lookahead's wiring
of it (a probe sample in, the per-layer counts on the device out), all on the CPU."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ftexpert.gpu_worker.backends.offload.prefetch_budget import (OnlineBudget, break_even, expected_gain_s,
                                                                prefetch_count)
from ftexpert.gpu_worker.backends.offload.prefetch_probe import ProbeSample

BW = 50e9                       # bytes/s: the H200's PCIe link, about
BF16 = 9_437_184                # qwen3-30b-a3b expert bytes in the store: bf16
NVFP4 = 2_654_224               # and nvfp4
T16 = BF16 / BW                 # one bf16 expert's copy: 188.7 us
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
TIMINGS = json.loads((Path(__file__).with_name("data") / "prefetch_timings.json").read_text())["scenarios"]


# -- the rule: hand-computed (victim cost c = 0.25: a fully hidden copy needs p > 0.2, half hidden p > 0.6) -------
TABLE = [
    # (what, idle window s, expert bytes, probs, saved share s, cap, expected count)
    ("no idle time", 0.0, BF16, [0.99, 0.9], 1.0, None, 0),
    ("a negative window (link busy past ensure)", -3e-5, BF16, [0.99], 1.0, None, 0),
    ("fits 3, all above break-even", 3 * T16, BF16, [0.9, 0.8, 0.7, 0.6], 1.0, None, 3),
    ("fits 3, only 2 above break-even", 3 * T16, BF16, [0.9, 0.5, 0.15, 0.9], 1.0, None, 2),
    ("a half-hidden third copy clears 0.6", 2.5 * T16, BF16, [0.9, 0.9, 0.7], 1.0, None, 3),
    ("a half-hidden third copy below 0.6", 2.5 * T16, BF16, [0.9, 0.9, 0.55], 1.0, None, 2),
    ("a 40%-hidden copy needs p > 0.68", 0.4 * T16, BF16, [0.99], 1.0, None, 1),
    ("a 40%-hidden copy at 0.6 is left", 0.4 * T16, BF16, [0.6], 1.0, None, 0),
    ("the window outlasts the candidates", 10 * T16, BF16, [0.9] * 4, 1.0, None, 4),
    ("the cap", 10 * T16, BF16, [0.9] * 4, 1.0, 2, 2),
    ("a prefix: a poor second rank stops it", 3 * T16, BF16, [0.9, 0.1, 0.9], 1.0, None, 1),
    ("no candidate measured yet", 3 * T16, BF16, [], 1.0, None, 0),
    ("the same 0.2 ms: bf16 fits one", 200e-6, BF16, [0.95, 0.9, 0.8, 0.7, 0.6], 1.0, None, 1),
    ("the same 0.2 ms: nvfp4 fits 3 and 77% of a 4th", 200e-6, NVFP4, [0.95, 0.9, 0.8, 0.7, 0.6], 1.0, None, 4),
    ("hybrid f = 0.5: a fully hidden copy still needs only p > 0.2", 2 * T16, BF16, [0.3, 0.25], 0.5, None, 2),
    ("hybrid f = 0.5: a half-hidden one would need p > 1", 2.5 * T16, BF16, [0.9, 0.9, 0.99], 0.5, None, 2),
    ("strategy cpu (s = 0): nothing", 10 * T16, BF16, [0.99], 0.0, None, 0),
]


@pytest.mark.parametrize("what, idle, nbytes, probs, saved, cap, want", TABLE, ids=[row[0] for row in TABLE])
def test_the_rule_on_a_table_of_hand_computed_outcomes(what, idle, nbytes, probs, saved, cap, want):
    assert prefetch_count(idle, BW, nbytes, probs, saved=saved, cap=cap) == want


def test_the_break_even_and_its_gain():
    assert break_even(1.0) == pytest.approx(0.2)          # c / (1 + c)
    assert break_even(0.5) == pytest.approx(0.6)
    assert break_even(0.0) == pytest.approx(1.0)          # a copy not hidden at all: never
    assert break_even(1.0, saved=0.5) == pytest.approx(0.2)
    assert break_even(0.5, saved=0.5) == pytest.approx(1.0)
    assert math.isinf(break_even(1.0, saved=0.0))
    assert break_even(1.0, victim_cost=0.0) == 0.0        # with no eviction cost, a hidden copy always pays
    # the count maximises the expected gain: one fewer or one more (if there is one) gains less
    probs = [0.9, 0.8, 0.35, 0.3]
    n = prefetch_count(2.3 * T16, BW, BF16, probs)
    gains = [expected_gain_s(m, 2.3 * T16, BW, BF16, probs) for m in range(len(probs) + 1)]
    assert n == 2 and gains[n] == max(gains) and gains[n] > 0


# -- the online estimates on recorded timings against a plain reference --------------------------------------------
def samples(name: str) -> tuple[int, list[ProbeSample]]:
    """A scenario's steps as LinkProbe samples (rank counts cumulative, as the Lookahead reads them)."""
    sc = TIMINGS[name]
    seen_each = sc["rank_seen"]
    out, seen, hits = [], None, None
    for step in sc["steps"]:
        per_layer = [[0] * 8] + [[DIGITS.index(ch) for ch in word] for word in step["rank_hits"].split()]
        layers = len(per_layer)
        if seen is None:
            seen, hits = [[0] * 9 for _ in range(layers)], [[0] * 9 for _ in range(layers)]
        for layer in range(1, layers):
            for r in range(8):
                seen[layer][r] += seen_each
                hits[layer][r] += per_layer[layer][r]
        windows = [None if w is None else w * 1e-6 for w in step["windows_us"]]
        out.append(ProbeSample(windows, [None] + [0.0] * (layers - 1), step["copies"] * sc["expert_bytes"],
                               step["copy_us"] * 1e-6, [[[row[:] for row in seen], [row[:] for row in hits]]]))
    return sc["expert_bytes"], out


class ReferenceBudget:
    """The spec of docs/PREFETCH.md "auto", written out plainly: per layer an exponentially weighted mean m and
    mean absolute deviation d of the window (the first sample sets m, d = 0; then d += a(|x - m| - d), m += a(x - m)),
    the window used max(0, m - d - join mean); the same mean of the bandwidth and of each rank's hit rate over the
    samples that saw it; then the longest prefix of ranks with p_i > (1 - h_i + c s) / (s (1 + c))."""

    def __init__(self, layers: int, k: int, nbytes: int, a: float = 0.3, c: float = 0.25):
        self.layers, self.k, self.nbytes, self.a, self.c = layers, k, nbytes, a, c
        self.win = [None] * layers                 # (m, d)
        self.join = [0.0] * layers
        self.bw = None
        self.prec = [[None] * k for _ in range(layers)]
        self.last = None

    def _ewma(self, old, x):
        if old is None:
            return (x, 0.0)
        m, d = old
        return (m + self.a * (x - m), d + self.a * (abs(x - m) - d))

    def feed(self, s: ProbeSample) -> None:
        for layer, w in enumerate(s.windows):
            if w is not None:
                self.win[layer] = self._ewma(self.win[layer], w)
        if s.copy_bytes > 0 and s.copy_s > 0:
            x = s.copy_bytes / s.copy_s
            self.bw = x if self.bw is None else self.bw + self.a * (x - self.bw)
        seen, hits = s.snapshot[0]
        for layer in range(self.layers):
            for r in range(self.k):
                d_seen = seen[layer][r] - (self.last[0][layer][r] if self.last else 0)
                d_hit = hits[layer][r] - (self.last[1][layer][r] if self.last else 0)
                if d_seen > 0:
                    rate = d_hit / d_seen
                    old = self.prec[layer][r]
                    self.prec[layer][r] = rate if old is None else old + self.a * (rate - old)
        self.last = (seen, hits)

    def budgets(self, saved: float = 1.0) -> list[int]:
        out = [0]
        for layer in range(1, self.layers):
            if self.win[layer] is None or self.bw is None:
                out.append(0)
                continue
            m, d = self.win[layer]
            idle = max(0.0, m - d - self.join[layer])
            t = self.nbytes / self.bw
            n = 0
            while n < self.k and self.prec[layer][n] is not None:
                h = min(max((idle - n * t) / t, 0.0), 1.0)
                if idle <= 0 or not self.prec[layer][n] > (1 - h + self.c * saved) / (saved * (1 + self.c)):
                    break
                n += 1
            out.append(n)
        return out


def lookahead_for(layers: int, k: int, nbytes: int):
    """A CPU Lookahead (mode auto) over a cache of `layers` x 16 experts whose slots hold `nbytes` a row."""
    from ftexpert.gpu_worker.backends.offload.prefetch import Lookahead, PrefetchSettings, RandomPredictor
    from ftexpert.kernels.slot_cache import SlotCache
    cache = SlotCache.create(layers, 16, 32)
    slots = torch.zeros(1, nbytes // 2, dtype=torch.bfloat16).expand(cache.total_slots, -1)    # rows of nbytes
    return Lookahead(cache, slots, [None] * layers, None, PrefetchSettings(mode="auto", k=k),
                     RandomPredictor(16, k))


@pytest.mark.parametrize("name", sorted(TIMINGS))
def test_the_lookahead_follows_the_reference_on_recorded_timings(name, monkeypatch):
    """Each timed step's sample through Lookahead.step_begin (as the backend's step hook calls it): the per-layer
    counts it writes to the device equal the reference's after every sample."""
    nbytes, steps = samples(name)
    layers = len(steps[0].windows)
    follow_the_reference(lookahead_for(layers, 8, nbytes), ReferenceBudget(layers, 8, nbytes), steps, name,
                         monkeypatch)


def follow_the_reference(la, ref, steps: list[ProbeSample], name: str, monkeypatch) -> None:
    """Feed `steps` to the Lookahead as its probe's samples (Lookahead.step_begin) and to the reference: after every
    sample the per-layer counts it writes to the device equal the reference's."""
    feed = iter(steps)
    monkeypatch.setattr(la.probe, "begin_step", lambda snapshot: next(feed))
    for i, s in enumerate(steps):
        la.step_begin()
        ref.feed(s)
        want = ref.budgets()
        assert la.allowed == want, f"{name}, sample {i}"
        assert la.allow.tolist() == want


EXPECTED = {                 # the count most layers settle on (module docstring of the fixture's numbers)
    "bf16-offload-25": 0,    # the link busy ~99%: nothing fits
    "nvfp4-offload-25": 1,   # ~59 us idle, a 53 us copy: one
    "nvfp4-offload-50": 2,   # ~110 us idle: two, the third below its break-even (precision ~0.35, barely hidden)
    "nvfp4-saturating": 0,   # after the link saturates
}


def feed_rule(rule: OnlineBudget, steps: list[ProbeSample]):
    """Each sample into the rule as Lookahead.step_begin feeds it: the windows, the join waits, the copies' bandwidth
    and the per-rank counts since the last sample; yields the rule's per-layer counts after each sample."""
    last = None
    for s in steps:
        for layer, (w, j) in enumerate(zip(s.windows, s.joins)):
            if w is not None:
                rule.observe_window(layer, w)
            if j is not None:
                rule.observe_join(layer, j)
        rule.observe_bandwidth(s.copy_bytes, s.copy_s)
        seen, hits = s.snapshot[0]
        for layer in range(rule.num_layers):
            d_seen = [a - (last[0][layer][r] if last else 0) for r, a in enumerate(seen[layer])]
            d_hits = [a - (last[1][layer][r] if last else 0) for r, a in enumerate(hits[layer])]
            rule.observe_ranks(layer, d_seen, d_hits)
        last = (seen, hits)
        yield rule.budgets()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_rule_converges_and_falls_to_zero_on_a_saturated_link(name):
    nbytes, steps = samples(name)
    layers = len(steps[0].windows)
    rule = OnlineBudget(layers, 8, nbytes)
    history = [list(b) for b in feed_rule(rule, steps)]
    final = history[-1][1:]
    assert max(set(final), key=final.count) == EXPECTED[name], final
    assert sum(n == EXPECTED[name] for n in final) >= 0.8 * len(final)
    assert rule.bandwidth.mean == pytest.approx(BW, rel=0.05)
    if name == "nvfp4-saturating":
        assert max(max(h[1:]) for h in history[:8]) >= 2, "before saturating it prefetched"
        assert all(n == 0 for h in history[-4:] for n in h), "four samples after saturating: nothing"
        assert not rule.window_fits()
    if name == "bf16-offload-25":
        assert not rule.window_fits(), "auto runs no predictor where no window holds half a copy"


def test_a_cold_start_prefetches_nothing():
    """No window, bandwidth or precision measured yet: every count is 0 and auto does not predict."""
    rule = OnlineBudget(4, 8, BF16)
    assert rule.budgets() == [0, 0, 0, 0] and not rule.window_fits() and rule.expected_gain_s() == 0.0
    rule.observe_window(2, 10 * T16)
    rule.observe_bandwidth(BF16 * 10, 10 * T16)
    assert rule.budgets() == [0, 0, 0, 0], "no precision measured: nothing"
    assert rule.window_fits(), "a window: the predictor runs, to measure the precision"
    rule.observe_ranks(2, [4, 4], [4, 3])
    assert rule.budgets() == [0, 0, 2, 0]


def test_join_waits_shrink_the_window():
    """A layer whose prefetch copies were still landing at its ensure gets the window less the mean wait."""
    rule = OnlineBudget(2, 4, BF16)
    rule.observe_bandwidth(BF16, T16)
    rule.observe_ranks(1, [1, 1, 1, 1], [1, 1, 1, 1])
    rule.observe_window(1, 3 * T16)
    assert rule.budget(1) == 3
    rule.observe_join(1, 1.2 * T16)
    assert rule.budget(1) == 2          # 1.8 copies: the second 80% hidden (p = 1 > 0.36), the third not at all
