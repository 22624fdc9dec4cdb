"""The fetch-fraction tuner, driven by synthetic telemetry from a two-sided timing model."""
from __future__ import annotations

import json
import logging
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from ftexpert.coordinator.policy import DECISION_STEP, FetchPolicy, PolicySettings, StepTelemetry, build_policy, fraction_to_q16
from ftexpert.proto.bandwidth_profile import ExpertFormat, load_bandwidth_profile

FMT = ExpertFormat("bf16", 2048, 768)                     # 9.44 MB experts, as in qwen3-30b-a3b
BPE = FMT.bytes_per_expert


def simulate_step(policy: FetchPolicy, misses: int, pcie_gb_s: float, cpu_gb_s: dict[str, float],
                  rng: random.Random, noise: float = 0.05, overhead_s: float = 0.0) -> tuple[float, float]:
    """One step of a hybrid layer stack: fetch round(f*M), split the rest over workers by share.

    Returns (fetch side seconds, CPU side seconds)."""
    f = policy.effective_fraction()
    k = min(misses, round(f * misses))
    shares = policy.worker_shares() or {n: 1 / len(cpu_gb_s) for n in cpu_gb_s}
    left = misses - k
    cpu_experts, cpu_time = {}, {}
    for name, gb_s in cpu_gb_s.items():
        n = round(left * shares.get(name, 0.0))
        cpu_experts[name] = n
        cpu_time[name] = n * BPE / (gb_s * 1e9) * (1 + rng.uniform(-noise, noise)) + (overhead_s if n else 0.0)
    copy_s = k * BPE / (pcie_gb_s * 1e9) * (1 + rng.uniform(-noise, noise))
    cpu_side = max(cpu_time.values(), default=0.0)
    policy.observe(StepTelemetry(experts_fetched=k, copy_time_s=copy_s, cpu_experts=cpu_experts,
                                 cpu_time_s=cpu_time, gpu_wait_for_cpu_s=max(0.0, cpu_side - copy_s),
                                 gpu_wait_for_copy_s=max(0.0, copy_s - cpu_side)))
    return copy_s, cpu_side


def run(policy, steps, **kw):
    rng = random.Random(7)
    for _ in range(steps):
        simulate_step(policy, rng=rng, **kw)


def expected(pcie: float, cpus: dict[str, float]) -> float:
    return pcie / (pcie + sum(cpus.values()))


def test_converges_to_the_finishing_together_point_and_follows_a_slowed_cpu_then_a_slowed_link():
    policy = FetchPolicy(PolicySettings(), expert_format=FMT)
    cpus = {"cpu0": 26.0}
    run(policy, 200, misses=400, pcie_gb_s=54.6, cpu_gb_s=cpus)
    assert policy.effective_fraction() == pytest.approx(expected(54.6, cpus), abs=0.03)   # ~0.68

    cpus = {"cpu0": 6.0}                                           # CPU contended (FreeToken #151)
    run(policy, 200, misses=400, pcie_gb_s=54.6, cpu_gb_s=cpus)
    assert policy.effective_fraction() == pytest.approx(min(0.95, expected(54.6, cpus)), abs=0.03)

    cpus = {"cpu0": 26.0}
    run(policy, 200, misses=400, pcie_gb_s=8.0, cpu_gb_s=cpus)    # link slowed (pageable, shared)
    assert policy.effective_fraction() == pytest.approx(expected(8.0, cpus), abs=0.03)     # ~0.24
    snap = policy.snapshot()
    assert snap["source"] == "online" and snap["decisions_total"] > 3
    assert snap["pcie_gb_s"] == pytest.approx(8.0, rel=0.1) and snap["cpu_gb_s"] == pytest.approx(26.0, rel=0.1)


def test_at_convergence_both_sides_finish_together():
    policy = FetchPolicy(PolicySettings(), expert_format=FMT)
    rng = random.Random(1)
    for _ in range(300):
        copy_s, cpu_s = simulate_step(policy, 1000, 30.0, {"a": 20.0}, rng, noise=0.0)
    assert abs(copy_s - cpu_s) / max(copy_s, cpu_s) < 0.05


def test_per_worker_split_is_proportional_to_measured_throughput():
    policy = FetchPolicy(PolicySettings(), expert_format=FMT)
    cpus = {"numa0": 30.0, "numa1": 10.0}
    run(policy, 150, misses=400, pcie_gb_s=40.0, cpu_gb_s=cpus)
    shares = policy.worker_shares()
    assert shares["numa0"] == pytest.approx(0.75, abs=0.03) and shares["numa1"] == pytest.approx(0.25, abs=0.03)
    assert policy.effective_fraction() == pytest.approx(0.5, abs=0.03)
    assert [w["name"] for w in policy.snapshot()["workers"]] == ["numa0", "numa1"]


def test_bounds_hold_when_one_side_is_far_faster():
    policy = FetchPolicy(PolicySettings(fetch_fraction_min=0.1, fetch_fraction_max=0.8), expert_format=FMT)
    run(policy, 100, misses=200, pcie_gb_s=1000.0, cpu_gb_s={"c": 1.0})
    assert 0.8 - 2 * DECISION_STEP <= policy.effective_fraction() <= 0.8
    run(policy, 100, misses=200, pcie_gb_s=1.0, cpu_gb_s={"c": 1000.0})
    assert 0.1 <= policy.effective_fraction() <= 0.1 + 2 * DECISION_STEP


def test_fixed_fraction_and_strategies_are_not_tuned():
    policy = FetchPolicy(PolicySettings(), expert_format=FMT)
    policy.update(fetch_fraction=0.4)
    assert policy.settings.auto_tune is False
    run(policy, 50, misses=100, pcie_gb_s=50.0, cpu_gb_s={"c": 5.0})
    assert policy.effective_fraction() == pytest.approx(0.4)
    assert policy.snapshot()["fetch_fraction_q16"] == fraction_to_q16(0.4) == 26214
    policy.update(strategy="offload")
    assert policy.effective_fraction() == 1.0
    policy.update(strategy="cpu")
    assert policy.effective_fraction() == 0.0


@pytest.mark.parametrize("changes, message", [
    ({"fetch_fraction": 1.5}, "fetch_fraction=1.5"),
    ({"fetch_round": "nearest"}, "min-wait"),
    ({"strategy": "gpu"}, "hybrid"),
    ({"fetch_fraction_min": 0.9, "fetch_fraction_max": 0.1}, "swap"),
    ({"bogus": 1}, "unknown policy field"),
    ({"fetch_select": "recency"}, "unknown policy field"),
], ids=["fraction-above-1", "bad-rounding", "bad-strategy", "min-above-max", "unknown", "retired-selection"])
def test_bad_updates_are_refused_and_change_nothing(changes, message):
    policy = FetchPolicy(PolicySettings(), expert_format=FMT)
    before = policy.snapshot()
    with pytest.raises(ValueError, match=message):
        policy.update(**changes)
    assert policy.snapshot() == before


def _profile(tmp_path, gpu="NVIDIA H200", dtype="bfloat16", h=2048, i=768, pcie=54.6, cpu=26.0, **extra):
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"gpu_name": gpu, "entries": [
        {"dtype": dtype, "hidden_size": h, "intermediate_size": i, "pcie_gb_s": pcie, "cpu_gb_s": cpu, **extra}]}))
    return str(path)


def test_profile_for_this_hardware_sets_the_starting_fraction(tmp_path):
    path = _profile(tmp_path)
    policy = build_policy(PolicySettings(), fraction_given=False, benchbw_path=path, expert_format=FMT,
                          gpu_name="NVIDIA H200")
    assert policy.effective_fraction() == pytest.approx(54.6 / 80.6, abs=1e-3)
    assert policy.snapshot()["source"] == f"profile:{path}"


def test_profile_keys_the_reader_does_not_know_are_ignored(tmp_path):
    """`ft bench bw` writes more than the reader needs (p10s, the shared figures, ...); f still starts from
    the separate figures."""
    path = _profile(tmp_path, pcie_shared_gb_s=40.0, cpu_shared_gb_s=50.0, shared_gb_s=90.0, fetch_fraction=0.1)
    profile = load_bandwidth_profile(path, FMT, "NVIDIA H200")
    assert profile is not None and (profile.pcie_gb_s, profile.cpu_gb_s) == (54.6, 26.0)
    assert profile.fetch_fraction == pytest.approx(54.6 / 80.6)


@pytest.mark.parametrize("kw", [{"gpu": "NVIDIA A100-SXM4-80GB"}, {"h": 4096}, {"dtype": "float32"}],
                         ids=["other-gpu", "other-hidden-size", "other-dtype"])
def test_profile_from_other_hardware_is_ignored_with_a_log_line(tmp_path, caplog, kw):
    path = _profile(tmp_path, **kw)
    with caplog.at_level(logging.WARNING, logger="ft.bandwidth_profile"):
        assert load_bandwidth_profile(path, FMT, "NVIDIA H200") is None
    assert "ignoring bandwidth profile" in caplog.text and "ft bench bw" in caplog.text
    policy = build_policy(PolicySettings(), fraction_given=False, benchbw_path=path, expert_format=FMT,
                          gpu_name="NVIDIA H200")
    assert policy.effective_fraction() == 0.5 and policy.snapshot()["source"] == "default"


def test_unreadable_profile_is_ignored(tmp_path, caplog):
    path = tmp_path / "bw.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="ft.bandwidth_profile"):
        assert load_bandwidth_profile(str(path), FMT, "NVIDIA H200") is None
    assert "unreadable" in caplog.text


finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)
anyfloat = st.floats(allow_nan=True, allow_infinity=True)
telemetry = st.builds(
    StepTelemetry,
    experts_fetched=st.integers(min_value=-5, max_value=10_000),
    copy_time_s=st.one_of(finite, anyfloat),
    cpu_experts=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(min_value=-5, max_value=10_000)),
    cpu_time_s=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.one_of(finite, anyfloat)),
    gpu_wait_for_cpu_s=st.one_of(finite, anyfloat),
    gpu_wait_for_copy_s=st.one_of(finite, anyfloat),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(telemetry, max_size=40),
       lo=st.floats(min_value=0, max_value=1), width=st.floats(min_value=0, max_value=1))
def test_fraction_always_stays_finite_within_bounds_and_within_0_1(steps, lo, width):
    hi = min(1.0, lo + width)
    policy = FetchPolicy(PolicySettings(fetch_fraction=0.5, fetch_fraction_min=lo, fetch_fraction_max=hi),
                         expert_format=FMT)
    for t in steps:
        new = policy.observe(t)
        f = policy.effective_fraction()
        assert math.isfinite(f) and 0.0 <= f <= 1.0 and lo - 1e-12 <= f <= hi + 1e-12
        assert new is None or new == f
        assert 0 <= policy.snapshot()["fetch_fraction_q16"] <= 65536


def test_a_fixed_fetch_fraction_of_0_is_used_as_given_and_out_of_bounds_ones_are_refused():
    import argparse

    from ftexpert.coordinator.serve_cli import add_arguments, build_policy_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    fmt = ExpertFormat("bf16", 64, 32)
    for f in (0.0, 0.02, 1.0):
        args = parser.parse_args(["--moe-strategy", "hybrid", "--fetch-fraction", str(f)])
        policy = build_policy_from_args(args, fmt, "cpu")
        assert policy.effective_fraction() == f and policy.snapshot()["fetch_fraction"] == f   # not clamped to 0.05
    args = parser.parse_args(["--moe-strategy", "hybrid", "--fetch-fraction", "0", "--fetch-fraction-min", "0.1"])
    with pytest.raises(ValueError, match=r"fetch_fraction=0 is outside \[fetch_fraction_min=0.1"):
        build_policy_from_args(args, fmt, "cpu")
    policy = FetchPolicy(PolicySettings(strategy="hybrid"))
    with pytest.raises(ValueError, match="outside"):
        policy.update(fetch_fraction=0.0)                 # SetPolicy: refused, not moved to 0.05
    assert policy.update(fetch_fraction=0.0, fetch_fraction_min=0.0)["fetch_fraction"] == 0.0


def test_prefetch_fields_are_set_validated_and_reach_the_engine_message():
    """SetPolicy's prefetch / prefetch_budget: "" and 0 mean "as the engine started"; bad values change nothing;
    the engine's SetPolicy message carries them (the backend applies them, gpu_worker/backends/offload/slot_pool.py)."""
    from ftexpert.proto import engine_messages as em

    policy = FetchPolicy(PolicySettings(strategy="offload"))
    snap = policy.snapshot()
    assert snap["prefetch"] == "" and snap["prefetch_budget"] == 0
    snap = policy.update(prefetch="on", prefetch_budget=2)
    assert snap["prefetch"] == "on" and snap["prefetch_budget"] == 2
    for bad, message in (({"prefetch": "sometimes"}, "prefetch='sometimes' is not valid"),
                         ({"prefetch_budget": 129}, "prefetch_budget=129 is not valid")):
        with pytest.raises(ValueError, match=message):
            policy.update(**bad)
    assert policy.snapshot()["prefetch"] == "on" and policy.snapshot()["prefetch_budget"] == 2
    msg = em.SetPolicy(strategy="offload", fetch_fraction=1.0, fetch_round="split", cpu_share_names=[],
                       cpu_share_values=[], prefetch="on", prefetch_budget=2)
    fields = em.decode(em.encode(msg)).fields()
    assert fields["prefetch"] == "on" and fields["prefetch_budget"] == 2


def test_prefetch_figures():
    from ftexpert.coordinator.metrics import prefetch_figures

    got = prefetch_figures({"prefetch_predicted_total": 40, "prefetch_useful_total": 10,
                            "prefetch_layer_calls_total": 20, "expert_misses_total": 30})
    assert got == {"prefetch_precision": 0.25, "prefetch_useful_per_layer": 0.5, "prefetch_covered_share": 0.25,
                   "prefetch_auto_predicting_share": 0.0}
    assert prefetch_figures({})["prefetch_precision"] == 0.0
    guarded = prefetch_figures({"prefetch_auto_steps_total": 160, "prefetch_auto_predicting_steps_total": 40})
    assert guarded["prefetch_auto_predicting_share"] == 0.25
