"""bench/bench_moe_decode_quant.py runs its argument parsing and case list without a GPU (--dry-run), and
refuses a format the kernels lack before any GPU work."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")
SCRIPT = os.path.join(REPO, "bench", "bench_moe_decode_quant.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=120)


def test_dry_run_lists_every_format_and_batch_with_its_expert_bytes():
    proc = _run("--dry-run", "--formats", "fp8,int4-g32,nvfp4", "--tokens", "1,4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 8                                          # bf16 + 3 formats, T = 1 and 4
    assert lines[0].startswith("bf16") and "9437184 bytes" in lines[0]      # 3 * 2048 * 768 * 2
    fp8 = next(line for line in lines if line.startswith("fp8"))
    nbytes = int(fp8.split(":")[1].split()[0])
    assert 3 * 2048 * 768 < nbytes < 3 * 2048 * 768 * 1.01          # 1 byte a weight plus the block scales


def test_help_and_unknown_formats():
    assert _run("--help").returncode == 0
    proc = _run("--dry-run", "--formats", "int3")
    assert proc.returncode != 0 and "not supported" in proc.stderr
