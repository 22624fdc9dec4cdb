"""The policy inside a live server: engine stats become telemetry, decisions reach the engine."""
from __future__ import annotations

import os
import sys

import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, live_server  # noqa: E402
from grpc_support import control_channel  # noqa: E402

from ftexpert.coordinator.engine_service import telemetry_from_stats  # noqa: E402
from ftexpert.coordinator.policy import FetchPolicy, PolicySettings  # noqa: E402
from ftexpert.gpu_worker.engine.stats import EngineStats  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid.stats import HybridStats  # noqa: E402
from ftexpert.proto import control_rpc as rpc  # noqa: E402
from ftexpert.proto.engine_messages import flatten_stats  # noqa: E402


def test_engine_counters_drive_the_tuner_and_the_engine_gets_each_decision(tmp_path):
    # The fake engine reports 1 fetch per 50 us (20,000/s) and two CPU workers at 10,000 and 3,333
    # experts/s: f* = 20k / (20k + 13.33k) = 0.6.
    with live_server(tmp_path, engine_kwargs={"step_delay_s": 0.002}) as ls:
        c = openai.OpenAI(base_url=ls.base_url + "/v1", api_key="x", max_retries=0)
        for _ in range(3):
            c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100)
        with control_channel(ls.grpc_address) as channel:
            policy = rpc.ControlStub(channel).GetPolicy(rpc.msg.GetPolicyRequest(), timeout=10)
        assert policy.telemetry_steps_total > 0 and policy.source == "online"
        assert policy.target_fraction == pytest.approx(0.6, abs=0.01)
        assert policy.fetch_fraction > 0.55                        # moved from 0.5 toward 0.6
        pushed = [call["fetch_fraction"] for call in ls.engine.policy_calls]
        assert pushed[0] == 0.5 and pushed[-1] == pytest.approx(policy.fetch_fraction)
        # the CPU work split follows measured throughput: cpu0 10,000 experts/s, cpu1 3,333
        shares = ls.engine.policy_calls[-1]["cpu_shares"]
        assert shares["cpu0"] == pytest.approx(0.75, abs=0.02)
        assert shares["cpu1"] == pytest.approx(0.25, abs=0.02)


def test_telemetry_from_stats_reads_per_worker_counters():
    prev = flatten_stats({"experts_fetched_total": 10, "copy_time_s_total": 0.001,
                          "cpu_workers": {"numa0": {"experts_total": 4, "time_s_total": 0.002}}})
    cur = flatten_stats({"experts_fetched_total": 30, "copy_time_s_total": 0.003,
                         "cpu_workers": {"numa0": {"experts_total": 14, "time_s_total": 0.007}},
                         "gpu_wait_for_cpu_s_total": 0.0001})
    t = telemetry_from_stats(prev, cur)
    assert t.experts_fetched == 20 and t.copy_time_s == pytest.approx(0.002)
    assert t.cpu_experts == {"numa0": 10} and t.cpu_time_s["numa0"] == pytest.approx(0.005)
    assert t.gpu_wait_for_cpu_s == pytest.approx(0.0001)
    assert telemetry_from_stats(cur, cur) is None              # nothing happened: no telemetry


def test_device_path_waits_without_a_copy_side_do_not_reach_the_tuner():
    # The device hand-off times its joins (GPU waiting for the CPU) but has no copy-side wait: those waits
    # are reported for people and left out of the tuner's wait term, or the bias would only ever grow.
    # through the path the figures take: the backend's counters (HybridStats) -> EngineStats -> flat stats
    def engine_side(**counters):
        stats = EngineStats()
        stats.absorb_expert_counters(HybridStats(**counters).as_dict())
        return flatten_stats(stats)

    prev = engine_side(experts_fetched_total=10, gpu_wait_for_cpu_s_total=0.001)
    cur = engine_side(experts_fetched_total=20, gpu_wait_for_cpu_s_total=0.011,
                      gpu_wait_for_cpu_unpaired_s_total=0.008)
    t = telemetry_from_stats(prev, cur)
    assert t.gpu_wait_for_cpu_s == pytest.approx(0.002)       # only the host path's (paired) part
    paired = FetchPolicy(PolicySettings(strategy="hybrid", fetch_fraction=0.5))
    unpaired = FetchPolicy(PolicySettings(strategy="hybrid", fetch_fraction=0.5))
    for _ in range(50):
        unpaired.observe(telemetry_from_stats(prev, {**cur, "gpu_wait_for_cpu_s_total": 0.009}))
        paired.observe(telemetry_from_stats(prev, {**cur, "gpu_wait_for_cpu_unpaired_s_total": 0.0}))
    assert unpaired.snapshot()["wait_bias"] == 0.0
    assert paired.snapshot()["wait_bias"] > 0.1               # the same waits, paired, do move it
