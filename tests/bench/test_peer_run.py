"""bench/peer_llamacpp/run_peer.py: llama.cpp's and this project's figures into one table (docs/PEERS.md).

A stand-in llama-bench (a script printing jsonl rows the way llama-bench -o jsonl does) checks the llama.cpp side's
command and how its rows map to shares of the experts on the GPU; canned bench_engine.py output checks ours; the
table pairs the two. With a CPU build of llama-bench at hand, the tiny model runs through the real one.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf")

from bench.bench_engine import table_header, table_line  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(REPO, "bench", "peer_llamacpp", "run_peer.py")


def _run_peer():
    spec = importlib.util.spec_from_file_location("peer_run_peer", DRIVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rp = _run_peer()

FAKE_BENCH = r'''#!/usr/bin/env python3
import json, sys
a = sys.argv[1:]
if "--help" in a:
    print("usage: llama-bench [options]\n  -ncmoe, --n-cpu-moe <n>\n  -d, --n-depth <n>")
    sys.exit(0)
def opt(k):
    return a[a.index(k) + 1]
open(sys.argv[0] + ".args", "w").write(json.dumps(a))
for nc in map(int, opt("-ncmoe").split(",")):
    for d in map(int, opt("-d").split(",")):
        for n_p, n_g in ((int(opt("-p")), 0), (0, int(opt("-n")))):
            ts = [1000.0 / (1 + nc) + d / 1000 + i for i in range(int(opt("-r")))] if n_p else \
                 [100.0 / (1 + nc) + i for i in range(int(opt("-r")))]
            print(json.dumps({"build_commit": "unknown", "build_number": 0, "n_cpu_moe": nc, "n_threads": int(opt("-t")),
                              "n_prompt": n_p, "n_gen": n_g, "n_depth": d, "avg_ts": sum(ts) / len(ts),
                              "samples_ts": ts, "gpu_info": "fake", "cpu_info": "fake"}))
'''


def test_theirs_runs_one_llama_bench_over_the_shares_and_maps_its_rows(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH)
    fake.chmod(0o755)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, DRIVER, "--tiny", "--jobs", "qwen3-30b-a3b:q4_0", "--parts", "theirs",
                        "--llama-bench", str(fake), "--out", str(out), "--gguf-dir", str(tmp_path), "--runs", "3",
                        "--shares", "0.5", "--threads", "4", "--prompt-tokens", "64", "--decode-tokens", "8",
                        "--gguf-threads", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    args = json.loads((tmp_path / "llama-bench.args").read_text())
    # the tiny shape has 2 layers: all on the CPU, one (half of the experts on the GPU), none
    assert args[args.index("-ncmoe") + 1] == "0,1,2"
    assert args[args.index("-ngl") + 1] == "99" and args[args.index("-fa") + 1] == "1"
    assert args[args.index("-d") + 1] == "0,64" and args[args.index("-t") + 1] == "4"
    assert not list(tmp_path.glob("*.gguf"))                   # deleted after the run
    recs = [json.loads(line) for line in (out / "peer_results.jsonl").read_text().splitlines()]
    theirs = {(r["kind"], r["share"]): r for r in recs if r.get("side") == "theirs" and r["kind"] != "other"}
    assert set(theirs) == {(k, s) for k in ("decode", "prefill") for s in (0.0, 0.5, 1.0)}
    # decode = tg at depth --prompt-tokens, prefill = pp at depth 0; the median of the samples
    assert theirs["decode", 1.0]["tok_s"] == 101.0 and theirs["decode", 1.0]["test"] == "tg8@d64"
    assert theirs["prefill", 0.0]["tok_s"] == pytest.approx(1000.0 / 3 + 1)
    assert theirs["decode", 0.5]["name"] == "llama.cpp -ncmoe 1"
    assert any(r.get("kind") == "gguf_write" for r in recs)
    assert "| qwen3-30b-a3b | q4_0 | decode | 100% | llama.cpp -ncmoe 0 | 101.00 |" in (out / "peer_table.md").read_text()


def test_prefill_depth_runs_only_the_two_tests_of_the_table(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH)
    fake.chmod(0o755)
    out = tmp_path / "out"
    common = [sys.executable, DRIVER, "--tiny", "--jobs", "qwen3-30b-a3b:q4_0", "--parts", "theirs", "--llama-bench",
              str(fake), "--out", str(out), "--gguf-dir", str(tmp_path), "--runs", "2", "--shares", "0.5",
              "--threads", "4", "--prompt-tokens", "64", "--decode-tokens", "8", "--gguf-threads", "1"]
    p = subprocess.run(common + ["--prefill-depth", "64"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    args = json.loads((tmp_path / "llama-bench.args").read_text())
    assert args[args.index("-d") + 1] == "64"                 # one depth: pp and tg both after the 64-token context
    recs = [json.loads(line) for line in (out / "peer_results.jsonl").read_text().splitlines()]
    theirs = {(r["kind"], r["share"]): r for r in recs if r.get("side") == "theirs"}
    assert {k for k, _ in theirs} == {"decode", "prefill"}    # nothing run that the table leaves out
    assert theirs["prefill", 1.0]["test"] == "pp64@d64" and theirs["decode", 1.0]["test"] == "tg8@d64"
    bad = subprocess.run(common + ["--prefill-depth", "32"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "give 0 or --prompt-tokens" in bad.stderr


@pytest.mark.parametrize("layers, shares, expected", [
    # qwen3-30b-a3b's 48 layers: 10% is 43 layers on the CPU (10.4% on the GPU), paired with ours' 10% row
    (48, [0.1, 0.25, 0.5], {48: (0.0, 0.0), 43: (0.1, 5 / 48), 36: (0.25, 0.25), 24: (0.5, 0.5), 0: (1.0, 1.0)}),
    # gpt-oss-120b's 36 layers: 10% is 32 on the CPU (11.1%)
    (36, [0.1, 0.25, 0.5], {36: (0.0, 0.0), 32: (0.1, 4 / 36), 27: (0.25, 0.25), 18: (0.5, 0.5), 0: (1.0, 1.0)}),
    # two layers: 25% rounds to every layer on the CPU, which keeps its own row (0%)
    (2, [0.25, 0.5], {2: (0.0, 0.0), 1: (0.5, 0.5), 0: (1.0, 1.0)}),
])
def test_ncmoe_plan_pairs_each_share_with_the_nearest_whole_layers(layers, shares, expected):
    plan = rp.ncmoe_plan(layers, shares)
    assert plan.keys() == expected.keys()
    for n, (nominal, actual) in expected.items():
        assert plan[n][0] == nominal and plan[n][1] == pytest.approx(actual)


def _engine_text() -> str:
    """bench_engine.py's lines for two routings (its print formats)."""
    lines = ["loaded qwen3-30b-a3b resident in 20.0 s",
             "resident graphs model [300.0, 310.0, 305.0] (graph launch 20 us of a 3300 us step, host time)",
             "resident graphs zipf:1.0 [290.0, 295.0, 299.0] (graph launch 20 us of a 3300 us step, host time)",
             "host store 58.0 GB filled and pinned (True) in 30.0 s",
             "offload 25% model [120.0, 125.0, 130.0] ",
             "offload 25% zipf:1.0 [40.0, 42.0, 41.0] ",
             "", "qwen3-30b-a3b bfloat16 bf16 experts, NVIDIA H200, ...", table_header()]
    # the table as bench_engine prints it (its own formatter): every other cell a number unlike the misses
    for name, slots, tok, miss in (("resident graphs model", "-", 305.0, 0.0), ("resident graphs zipf:1.0", "-", 295.0, 0.0),
                                   ("offload 25% model", 1536, 125.0, 3.5), ("offload 25% zipf:1.0", 1536, 41.0, 61.2)):
        lines.append(table_line(name, slots, tok, 483.5, 50.0, 80.0, 77.0, 76.0, miss, 40.0, True, 70.1, 1.01))
    return "\n".join(lines)


def test_engine_rows_and_the_table_pair_ours_with_theirs(tmp_path, monkeypatch):
    monkeypatch.setattr(rp, "run_cmd", lambda cmd, log_path, timeout, env=None: (0, _engine_text()))
    res = rp.Results(tmp_path / "r.jsonl")
    args = type("A", (), dict(runs=3, prompt_tokens=1024, decode_tokens=128, shares=[0.25], part_timeout=9,
                              routing_ours="model,zipf:1.0"))()
    rp.part_engine(args, "qwen3-30b-a3b", "bf16", res, tmp_path)
    ours = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    got = {(r["name"], r["routing"]): (r["share"], r["tok_s"], r["misses_per_token"]) for r in ours}
    assert got == {("resident", "model"): (1.0, 305.0, 0.0), ("resident", "zipf:1.0"): (1.0, 295.0, 0.0),
                   ("offload 25%", "model"): (0.25, 125.0, 3.5), ("offload 25%", "zipf:1.0"): (0.25, 41.0, 61.2)}
    res.add(kind="decode", side="theirs", model="qwen3-30b-a3b", experts="bf16", share=0.25,
            name="llama.cpp -ncmoe 36", tok_s=20.5)
    res.add(kind="decode", side="theirs", model="qwen3-30b-a3b", experts="bf16", share=0.0,
            name="llama.cpp -ncmoe 48", tok_s=15.0)
    text = rp.table(rp.read_records([tmp_path / "r.jsonl"]))
    assert "| 25% | llama.cpp -ncmoe 36 | 20.50 | offload 25% | zipf:1.0, 61.2 miss/tok | 41.00 | 2.00 |" in text
    assert "| 25% | llama.cpp -ncmoe 36 | 20.50 | offload 25% | model, 3.5 miss/tok | 125.00 | 6.10 |" in text
    assert "| 100% | not measured | - | resident | model, 0.0 miss/tok | 305.00 | - |" in text
    assert "| 0% | llama.cpp -ncmoe 48 | 15.00 | - | - | - | - |" in text        # theirs alone: a row of its own


def _hybrid_text(rows: list[tuple[str, float]]) -> str:
    """bench_hybrid.py's lines (its own row formatter), each row's "row:" line as it ends, then the table."""
    from bench.bench_hybrid import TABLE_HEADER, table_row
    lines = ["host store 58.0 GB (pinned: True)", "B_pcie 53.0 GB/s, B_cpu 73.3 GB/s -> f 0.419"]
    made = [(name, dict(decode_tok_s=tok, misses_per_token=169.1, same_tokens=None)) for name, tok in rows]
    lines += [f"row: {table_row(name, r, 126e9, 109e9, 9437184)} {[tok, tok + 1.0]}" for (name, r), (_, tok)
              in zip(made, rows)]
    lines += ["", TABLE_HEADER] + [table_row(name, r, 126e9, 109e9, 9437184) for name, r in made]
    return "\n".join(lines)


def test_hybrid_runs_cpu_beside_the_first_share_over_one_store(tmp_path, monkeypatch):
    """Ours' cpu row (one layer's experts cached) rides the first hybrid share's bench_hybrid.py run (--cpu-cache);
    each further share runs alone; the rows land at their shares, cpu at 0% beside llama.cpp's all-CPU row."""
    cmds = []

    def fake(cmd, log_path, timeout, env=None):
        cmds.append(cmd)
        both = "--cpu-cache" in cmd
        share = float(cmd[cmd.index("--cache") + 1])
        return 0, _hybrid_text(([("cpu", 17.0)] if both else []) + [("hybrid split", 40.0 + 100 * share)])
    monkeypatch.setattr(rp, "run_cmd", fake)
    res = rp.Results(tmp_path / "r.jsonl")
    args = type("A", (), dict(runs=2, prompt_tokens=1024, decode_tokens=128, hybrid_shares=[0.25, 0.5],
                              part_timeout=9, routing_ours="zipf:1.0", cpu_threads=0))()
    rp.part_hybrid(args, "qwen3-30b-a3b", "bf16", res, tmp_path)
    opt = [{c[i]: c[i + 1] for i in range(len(c) - 1) if c[i] in ("--cache", "--variants", "--cpu-cache")}
           for c in cmds]
    assert [(o["--cache"], o["--variants"], o.get("--cpu-cache")) for o in opt] == [
        ("0.25", "=cpu,=hybrid split", "128"), ("0.5", "=hybrid split", None)]
    ours = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert {(r["name"], r["share"], r["tok_s"]) for r in ours} == {
        ("cpu (cache 128)", 0.0, 17.5), ("hybrid split (cache 0.25)", 0.25, 65.5),
        ("hybrid split (cache 0.5)", 0.5, 90.5)}
    res.add(kind="decode", side="theirs", model="qwen3-30b-a3b", experts="bf16", share=0.0,
            name="llama.cpp -ncmoe 48", tok_s=17.0)
    text = rp.table(rp.read_records([tmp_path / "r.jsonl"]))
    assert "| 0% | llama.cpp -ncmoe 48 | 17.00 | cpu (cache 128) | zipf:1.0 | 17.50 | 1.03 |" in text, text
    cmds.clear()
    args.hybrid_shares = []                                      # no hybrid share: cpu alone at its own cache
    rp.part_hybrid(args, "qwen3-30b-a3b", "bf16", rp.Results(tmp_path / "alone.jsonl"), tmp_path)
    assert [(c[c.index("--cache") + 1], c[c.index("--variants") + 1], "--cpu-cache" in c) for c in cmds] == [
        ("128", "=cpu", True)]


def _cpu_llama_bench():
    path = os.environ.get("PEER_LLAMA_BENCH") or os.path.join(REPO, "bench", "peer_llamacpp", "bin", "cpu",
                                                               "llama-bench")
    return path if os.access(path, os.X_OK) else None


@pytest.mark.skipif(_cpu_llama_bench() is None, reason="no llama-bench build (bench/peer_llamacpp/build.sh cpu)")
def test_theirs_through_the_real_llama_bench_on_the_tiny_model(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, DRIVER, "--tiny", "--jobs", "gpt-oss-120b:mxfp4", "--parts", "theirs",
                        "--llama-bench", _cpu_llama_bench(), "--out", str(out), "--gguf-dir", str(tmp_path),
                        "--runs", "1", "--shares", "0.5", "--threads", "2", "--prompt-tokens", "16",
                        "--decode-tokens", "4"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    recs = [json.loads(line) for line in (out / "peer_results.jsonl").read_text().splitlines()]
    theirs = {(r["kind"], r["share"]) for r in recs if r.get("side") == "theirs"}
    assert {("decode", 0.0), ("decode", 0.5), ("decode", 1.0), ("prefill", 1.0)} <= theirs, theirs
    assert all(r["tok_s"] > 0 for r in recs if r.get("side") == "theirs")
