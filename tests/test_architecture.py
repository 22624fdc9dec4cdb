"""The process diagram, enforced: `lint-imports` checks the import-linter contracts in pyproject.toml
(kernels and proto import no process package; coordinator, gpu_worker and cpu_expert_pool reach one
another only through gpu_worker.api and cpu_expert_pool.api)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not os.path.exists(exe):
        pytest.fail("lint-imports not found: pip install -e '.[test]' (import-linter)")
    return [exe]


def test_the_import_contracts_hold():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))}
    run = subprocess.run([*_lint_imports(), "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"import contracts broken:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout, run.stdout


def test_one_engine_assembly():
    """Every engine of the service is built by gpu_worker/assembly/build.py (build_engine, and BuiltEngine's
    fresh_engine for a restart over the same model): no other module of src/ calls Engine(...)."""
    import ast

    callers = []
    for path in sorted((REPO / "src" / "ftexpert").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Engine":
                callers.append(str(path.relative_to(REPO)))
    assert callers and set(callers) == {"src/ftexpert/gpu_worker/assembly/build.py"}, callers
