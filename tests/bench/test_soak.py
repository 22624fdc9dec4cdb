"""The soak harness at CI size: `bench/soak.py --duration-s 20 --kill-worker-at-s 8` against a live
`ft serve` (process mode, tiny model, CPU) must pass every check (docs/SOAK.md has the long runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_soak_ci_run_passes_every_check(tmp_path):
    out_json = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "soak.py"), "--duration-s", "20",
                           "--kill-worker-at-s", "8", "--concurrency", "4", "--json", str(out_json)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(out_json.read_text())
    assert all(c["ok"] for c in summary["checks"]), summary["checks"]
    kinds = {k["kind"]: k for k in summary["kinds"]}
    for kind in ("completion", "stream", "chat", "sampled", "bad", "disconnect"):
        assert kinds[kind]["ok"] > 0, f"no successful {kind} request: {kinds[kind]}"
    (kill,) = summary["kills"]
    assert kill["recovered_s"] is not None and kill["recovered_s"] < 30
