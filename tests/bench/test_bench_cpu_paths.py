"""The engine benches' CPU paths, a few tokens each on the tiny model: every one builds its engines through
build_engine (resident rows over one model, offload / hybrid rows over its dense weights and one host store), so a
run that completes with lossless rows shows the spec, the reuse and the borrowed store and pool at work. The GPU
numbers come from bench/run_gpu.sh."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--runs", "1", "--prompt-tokens", "16"]

RUNS = {
    "bench_engine": [*SMALL, "--preset", "tiny", "--decode-tokens", "8", "--fractions", "0.5", "--batch", "2",
                     "--graphs", "both", "--copy-split", "both", "--routing", "model,zipf:0.5", "--expert-compute", "gemv",
                     "--kv-block-size", "32"],
    "bench_prefill": [*SMALL, "--preset", "tiny", "--chunks", "8,64", "--fractions", "0.5",
                      "--variants", "offload,hybrid", "--attention", "auto,bias"],
    "bench_hybrid": [*SMALL, "--preset", "tiny", "--decode-tokens", "8", "--handoff-calls", "50", "--cache", "16",
                     "--variants", "offload,=cpu,=hybrid split", "--prefetch-budgets", "auto", "--fetch-fraction",
                     "0.5", "--cpu-cache", "8"],
    "bench_prefetch": ["--device", "cpu", "--runs", "1", "--prompt-tokens", "16", "--preset", "tiny",
                       "--routing", "zipf:1.0", "--fractions", "0.5", "--batch", "1,2", "--prefetch", "off,on,measure",
                       "--prefetch-budget", "2", "--decode-tokens", "8", "--warmup-tokens", "4",
                       "--record-probe", "{tmp}/probe.json"],
    "prefetch_quality": ["--budgets", "2", "--prompts", "2", "--prompt-tokens", "16", "--new-tokens", "8", "--json"],
}


def _run(name: str, tmp_path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(REPO, "src"), REPO,
                                                                      os.environ.get("PYTHONPATH", "")])),
           "FT_CACHE_DIR": str(tmp_path / "cache"), "OUT": str(tmp_path)}
    args = [a.replace("{tmp}", str(tmp_path)) for a in RUNS[name]]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", f"{name}.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_bench_runs_its_cpu_path_and_its_rows_are_lossless(name, tmp_path):
    out = _run(name, tmp_path)
    if name == "prefetch_quality":
        rows = json.loads(out.strip().splitlines()[-1])["rows"]
        assert rows and all(r["lossless"] for r in rows)
    elif name == "bench_prefetch":
        rows = [line for line in out.splitlines() if line.startswith("| 50% |")]
        assert len(rows) == 6 and all(line.rstrip(" |").endswith("True") for line in rows), out
        probe = json.loads((tmp_path / "probe.json").read_text())       # the measure runs' probe samples
        samples = [x for name, sc in probe["scenarios"].items() if "measure" in name for x in sc["samples"]]
        assert samples and all(len(x["rank_counts"][0]) == probe["layers"] for x in samples), probe
    elif name == "bench_hybrid":
        rows = json.loads((tmp_path / "bench_hybrid.json").read_text())["rows"]
        assert {r["backend"] for r in rows} >= {"resident", "offload", "cpu", "hybrid split", "hybrid split prefetchauto"}
        assert all(r["same_tokens"] in (None, True) for r in rows if r["backend"].startswith("offload")), rows
        caches = {r["backend"]: r.get("cache") for r in rows}      # --cpu-cache: the cpu row's own cache
        assert (caches["cpu"], caches["hybrid split"], caches["offload"]) == ("8", "16", "16"), caches
    else:                          # the table's rows: every offload (and hybrid) one lossless against resident
        table = out[out.index("\nbackend"):].splitlines()[2:]
        offload = [line for line in table if line.startswith(("offload", "hybrid"))]
        assert offload and all("True" in line.split() for line in offload), out


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_hybrid_rows_become_engine_specs_and_hybrid_options():
    """A variant's fields land in the engine spec (strategy, copy, eviction key, prefetch) or in the cpu / hybrid
    options (f, rounding, promotion); the live tuner and the shared probe's f stay the bench's."""
    from ftexpert.proto.engine_spec import EngineSpec
    bench = _bench("bench_hybrid")
    base = EngineSpec(preset="tiny", device="cpu", moe_cache_size="16", moe_prefetch="off")
    args = argparse.Namespace(freq_half_life=None)
    spec, hybrid, tune, budget = bench.row_spec(base, {"strategy": "offload", "split_copy": False,
                                                       "freq_weight": 256, "prefetch": 4}, args, 0.3, None, None)
    assert (spec.moe_strategy, spec.expert_copy, spec.eviction_freq_weight, spec.moe_prefetch,
            spec.moe_prefetch_budget, hybrid, tune, budget) == ("offload", "whole", 256, "on", 4, None, False, 4)
    shared = argparse.Namespace(fetch_fraction=0.7)
    spec, hybrid, tune, budget = bench.row_spec(base, {"strategy": "hybrid", "fetch_round": "split", "promote": True,
                                                       "tune": True, "fetch_fraction": "shared", "prefetch": "auto"},
                                                argparse.Namespace(freq_half_life=96), 0.3, shared, "off")
    assert (spec.moe_strategy, spec.moe_prefetch, spec.pdl, spec.eviction_freq_half_life) == ("hybrid", "auto", "off", 96)
    assert (hybrid.fetch_fraction, hybrid.fetch_round, hybrid.promote, tune) == (0.7, "split", True, True)
    spec, hybrid, _, budget = bench.row_spec(base, {"strategy": "cpu"}, args, 0.3, None, None)
    assert spec.moe_strategy == "cpu" and spec.moe_prefetch == "off" and hybrid.fetch_fraction == 0.3 and budget == 0
    assert spec.moe_cache_size == "16"
    # --cpu-cache: the cpu rows' own cache, the other rows keep --cache
    with_cpu_cache = argparse.Namespace(freq_half_life=None, cpu_cache="8")
    assert bench.row_spec(base, {"strategy": "cpu"}, with_cpu_cache, 0.3, None, None)[0].moe_cache_size == "8"
    assert bench.row_spec(base, {"strategy": "hybrid", "fetch_round": "split", "promote": True}, with_cpu_cache, 0.3,
                          None, None)[0].moe_cache_size == "16"


def test_bench_prefetch_steps_line_is_the_median_over_runs_of_each_figure():
    """The "steps:" line: each figure the median of its runs' values, the in-graph and between-graph times apart."""
    bench = _bench("bench_prefetch")
    runs = [dict(graph_ms=5.0, graph_mean_ms=5.5, between_ms=0.10, between_mean_ms=0.30),
            dict(graph_ms=5.2, graph_mean_ms=5.9, between_ms=0.12, between_mean_ms=0.50),
            dict(graph_ms=9.0, graph_mean_ms=9.9, between_ms=0.90, between_mean_ms=0.90)]
    assert bench.steps_line(0.5, 1, ("auto", 0), runs) == (
        "steps: 50% batch 1 auto : GPU in the graph 5.200 ms (mean 5.900), between graphs 0.120 ms (mean 0.500), "
        "medians of the runs")


def test_bench_engine_lossless_cell_names_the_first_differing_position():
    """The lossless cell: True, or False@N with N the first decode position at which any request differs (0: the
    token sampled from the prefill's logits), and '*' where the configuration's own runs disagreed."""
    bench = _bench("bench_engine")
    ref = [[5, 6, 7, 8], [1, 2, 3, 4]]
    cases = [([[5, 6, 7, 8], [1, 2, 3, 4]], True, None, "True"),
             ([[5, 6, 7, 9], [1, 2, 0, 4]], False, 2, "False@2"),
             ([[0, 6, 7, 8], [1, 2, 3, 4]], False, 0, "False@0"),
             ([[5, 6], [1, 2, 3, 4]], False, 2, "False@2")]
    for tokens, lossless, diff, cell in cases:
        r = {"first_tokens": tokens}
        bench.compare_to(r, ref)
        assert (r["lossless"], r["first_diff"], bench.lossless_cell(r)) == (lossless, diff, cell)
    r = {"first_tokens": ref, "runs_agree": False}
    bench.compare_to(r, [[5, 6, 7, 8], [1, 2, 3, 5]])
    assert bench.lossless_cell(r) == "False@3*"
    assert bench.lossless_cell({}) == "-"
