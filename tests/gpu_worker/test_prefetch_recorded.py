"""The `auto` prefetch's budget rule on link-probe samples recorded on a GPU (data/prefetch_probe_nvfp4_h100.json,
written by `bench_prefetch.py --record-probe` in the prefetch suite: qwen3-30b-a3b, nvfp4 experts, the trained
trace, batch 1, caches of 10 / 25 / 50%, 8 timed steps each). The samples go through `Lookahead.step_begin` as the
backend's step hook feeds them; its per-layer counts (idle window -> bytes -> candidates, each rank's precision
against its break-even) must equal a plain reference written here after every sample, and they must respect what
the recorded figures allow: no layer takes a copy its window cannot hide, and a link with no window gets nothing."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ftexpert.gpu_worker.backends.offload.prefetch_budget import OnlineBudget
from ftexpert.gpu_worker.backends.offload.prefetch_probe import ProbeSample
from tests.gpu_worker.test_prefetch_budget import ReferenceBudget, feed_rule, follow_the_reference, lookahead_for

RECORDED = json.loads((Path(__file__).with_name("data") / "prefetch_probe_nvfp4_h100.json").read_text())
SCENARIOS = sorted(RECORDED["scenarios"])


def recorded_samples(name: str) -> list[ProbeSample]:
    """A scenario's samples as LinkProbe returns them (seconds; rank counts cumulative, [seen, routed])."""
    def s(v):
        return None if v is None else v * 1e-6
    return [ProbeSample([s(w) for w in r["windows_us"]], [s(j) for j in r["joins_us"]], float(r["copy_bytes"]),
                        (r["copy_us"] or 0.0) * 1e-6, [r["rank_counts"]])
            for r in RECORDED["scenarios"][name]["samples"]]


class ReferenceWithJoins(ReferenceBudget):
    """The reference, with the join waits the recorded samples carry: the window used is cut by the mean (same
    weights) of max(join, 0), the time the compute stream would have waited for the layer's prefetch copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._joins = [None] * self.layers

    def feed(self, s: ProbeSample) -> None:
        super().feed(s)
        for layer, j in enumerate(s.joins):
            if j is not None:
                x = max(j, 0.0)
                old = self._joins[layer]
                self._joins[layer] = x if old is None else old + self.a * (x - old)
        self.join = [0.0 if j is None else j for j in self._joins]


def test_the_recording_is_what_the_tests_expect():
    assert RECORDED["layers"] == 48 and RECORDED["k"] == 16 and RECORDED["expert_bytes"] == 2_654_224
    assert SCENARIOS == ["nvfp4-auto-0.1-b1", "nvfp4-auto-0.25-b1", "nvfp4-auto-0.5-b1"]
    for name in SCENARIOS:
        samples = recorded_samples(name)
        assert len(samples) == 8
        assert all(len(s.windows) == 48 and s.windows[0] is None for s in samples)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_lookahead_follows_the_reference_on_recorded_samples(name, monkeypatch):
    """Each recorded sample through Lookahead.step_begin: the counts it writes to the device equal the reference's
    after every sample, and at the end some layer is allowed a copy (the recorded windows hold one)."""
    steps = recorded_samples(name)
    k, nbytes = RECORDED["k"], RECORDED["expert_bytes"]
    la = lookahead_for(RECORDED["layers"], k, nbytes)
    follow_the_reference(la, ReferenceWithJoins(RECORDED["layers"], k, nbytes), steps, name, monkeypatch)
    assert sum(la.allowed) > 0 and la.active


def _rule_after(name: str) -> OnlineBudget:
    rule = OnlineBudget(RECORDED["layers"], RECORDED["k"], RECORDED["expert_bytes"])
    for _ in feed_rule(rule, recorded_samples(name)):
        pass
    return rule


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_layer_takes_a_copy_its_recorded_window_cannot_hide(name):
    """A candidate whose copy would start after the window closed is never hidden, so it never clears its
    break-even: a layer's count is at most ceil(window / copy time). The recorded link (~33-47 GB/s) copies an
    nvfp4 expert in ~56-80 us, and the windows are ~45-130 us: at most 2 a layer."""
    rule = _rule_after(name)
    t = RECORDED["expert_bytes"] / rule.bandwidth.mean
    assert 55e-6 < t < 82e-6
    for layer in range(1, rule.num_layers):
        n = rule.budget(layer, cap=RECORDED["k"])
        assert n <= math.ceil(rule.idle_s(layer) / t), (layer, n, rule.idle_s(layer), t)
        assert n <= 2


def test_a_higher_precision_earns_more_copies_on_the_same_windows():
    """The 10% cache's guesses were right more often than the 50% cache's (the trace's recorded precision: ~0.9
    against ~0.6 at rank 0), on windows of about the same length: the rule allows more at 10%, and at 50% it leaves
    some layers out altogether."""
    low, high = _rule_after("nvfp4-auto-0.1-b1"), _rule_after("nvfp4-auto-0.5-b1")
    n_low = [low.budget(layer) for layer in range(1, low.num_layers)]
    n_high = [high.budget(layer) for layer in range(1, high.num_layers)]
    assert sum(n_low) > sum(n_high)
    assert 0 in n_high and 0 not in n_low
    assert low.expected_gain_s() > 2 * high.expected_gain_s() > 0


def test_with_the_windows_shut_the_recorded_rule_allows_nothing():
    """The same recorded precisions and bandwidth, then samples whose windows are gone (the link busy up to each
    ensure): after a few samples every count is 0 and auto stops predicting."""
    rule = _rule_after("nvfp4-auto-0.25-b1")
    assert rule.window_fits()
    for _ in range(12):
        for layer in range(1, rule.num_layers):
            rule.observe_window(layer, -5e-6)
            rule.observe_join(layer, 0.0)
    assert all(rule.budget(layer) == 0 for layer in range(rule.num_layers))
    assert not rule.window_fits()


BF16 = json.loads((Path(__file__).with_name("data") / "prefetch_probe_bf16_h100.json").read_text())


@pytest.mark.parametrize("name", sorted(BF16["scenarios"]))
def test_bf16_experts_recorded_windows_hold_no_copy(name):
    """bf16 experts (9.44 MB, data/prefetch_probe_bf16_h100.json: the same suite's bf16 part, H100, on 768fe7c):
    a copy takes ~190-220 us on the recorded link against windows of ~45-57 us a layer, so no candidate clears its
    break-even, the rule allows nothing and auto runs no predictor, as the measured rows did ("predicting False",
    auto within 0.6% of off)."""
    rule = OnlineBudget(BF16["layers"], BF16["k"], BF16["expert_bytes"])
    samples = [ProbeSample([None if w is None else w * 1e-6 for w in r["windows_us"]],
                           [None if j is None else j * 1e-6 for j in r["joins_us"]], float(r["copy_bytes"]),
                           (r["copy_us"] or 0.0) * 1e-6, [r["rank_counts"]] if r["rank_counts"] else [])
               for r in BF16["scenarios"][name]["samples"]]
    assert len(samples) >= 4 and BF16["expert_bytes"] == 9_437_184
    for _ in feed_rule(rule, samples):
        pass
    t = BF16["expert_bytes"] / rule.bandwidth.mean
    assert 150e-6 < t < 260e-6
    windows = [rule.idle_s(layer) for layer in range(1, rule.num_layers)]
    assert max(windows) < t / 2
    assert all(rule.budget(layer, cap=BF16["k"]) == 0 for layer in range(rule.num_layers))
    assert not rule.window_fits() and rule.expected_gain_s() == 0.0

