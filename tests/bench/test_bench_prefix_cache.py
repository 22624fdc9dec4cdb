"""bench/bench_prefix_cache.py runs on the CPU with the embedded model: a chat turn's TTFT with the prefix cache off
and on (on finds the history's full blocks cached), decode tokens / s at a context, and a batch row whose pool is
sized by --kv-cache-gib, not by the longest context of every slot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "bench_prefix_cache.py")


def test_runs_on_the_cpu_with_the_embedded_model(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--history-tokens", "64", "--answer-tokens",
                           "4", "--turn-tokens", "8", "--runs", "1", "--decode-contexts", "32", "--decode-tokens", "4",
                           "--batch", "3", "--batch-context", "40", "--batch-max-context", "4096",
                           "--kv-cache-gib", "0.01", "--profile", "--json-out", str(out)], capture_output=True, text=True,
                          timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    off, on, decode, batch = rows
    assert (off["prefix_cache"], on["prefix_cache"]) == (False, True)
    assert off["hit_tokens"] == 0 and on["hit_tokens"] == 64 and on["prompt_tokens"] == 64 + 4 + 8
    assert decode["context"] == 32 and decode["tokens_per_s"] > 0
    # 3 requests of 40 prompt + 4 new tokens: 3 blocks of 16 each at their peak; the pool is 0.01 GiB while fixed rows
    # of 4,096 positions for 3 slots would take more
    assert batch["batch"] == 3 and batch["tokens_per_s"] > 0 and batch["peak_blocks"] == 9
    assert batch["pool_bytes"] <= 0.01 * 2**30 < batch["fixed_rows_bytes"]
    # --profile: one more turn of each kind, profiled (no GPU kernels on the CPU), beside the medians' rows
    assert "profile of a turn, prefix cache off" in proc.stdout and "profile of a turn, prefix cache on" in proc.stdout


def test_offload_rows_count_the_experts_each_turn_fetched(tmp_path):
    """Offload with a synthetic routing: the turn without the prefix cache prefills the whole history and fetches
    more experts than the turn that finds it cached; each decode row says its misses a token; resident rows say
    neither."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--history-tokens", "256", "--answer-tokens",
                           "4", "--turn-tokens", "8", "--runs", "1", "--decode-contexts", "32", "--decode-tokens", "8",
                           "--moe-strategy", "offload", "--moe-cache-size", "16", "--routing", "zipf:1.0",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    off, on, decode = json.loads(out.read_text())
    assert "routing zipf:1.0" in proc.stdout
    assert on["hit_tokens"] == 256 and off["hit_tokens"] == 0
    # the embedded model: 4 layers of 8 experts, 16 slots for the 32: a 268-token prefill routes to all of them
    assert off["experts_fetched"] > on["experts_fetched"] > 0
    assert 0 < decode["misses_per_token"] <= 2 * 4      # top-2 of 8 over 4 layers: at most 8 distinct a token
    assert "misses a token" in proc.stdout and "experts fetched" in proc.stdout


def test_an_unknown_routing_is_refused():
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--routing", "uniform"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert proc.returncode == 2 and "--routing" in proc.stderr


def test_qwen3_next_turns_resume_the_kept_state(tmp_path):
    """A tiny Qwen3-Next: the turn with the prefix cache finds the history up to the last block the first turn
    completed (200 history + 16 answer tokens: 208, blocks of 16) and resumes the linear layers' state kept there."""
    from tests.gpu_worker.qwen3_next_util import hf_qwen3_next, save
    model = save(hf_qwen3_next(seed=7), tmp_path / "next")
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--model", str(model), "--device", "cpu", "--history-tokens", "200",
                           "--turn-tokens", "20", "--runs", "1", "--decode-contexts", "", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    off, on = json.loads(out.read_text())
    assert (off["hit_tokens"], off["state_restores"]) == (0, 0)
    assert (on["hit_tokens"], on["state_restores"], on["prompt_tokens"]) == (208, 1, 236)
    assert "the linear layers' state restored" in proc.stdout
