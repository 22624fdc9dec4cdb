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
                           "--kv-cache-gib", "0.01", "--json-out", str(out)], capture_output=True, text=True, timeout=300,
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
