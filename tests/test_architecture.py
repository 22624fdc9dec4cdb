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


# The Engine class's own unit tests that hand it what no spec carries: they may construct an Engine themselves.
ENGINE_UNIT_TESTS = {
    "tests/gpu_worker/test_engine_stops.py": "the stop rules with EOS ids the test chooses (Engine's eos_token_ids)",
    "tests/gpu_worker/test_engine_paged.py": "paging and preemption over pools sized in tokens (kv_cache_tokens)",
    "tests/gpu_worker/test_engine_grammar.py": "the grammar masks over the test's configs and grammar compiler",
    "tests/gpu_worker/test_engine_logprobs.py": "the sampler's logprobs beside a recomputation on the test's configs",
}
ENGINE_BUILDER = "src/ftexpert/gpu_worker/assembly/build.py"


def engine_constructions(root: Path = REPO) -> dict[str, int]:
    """Every `Engine(...)` call in src/, bench/ and tests/: file -> count."""
    import ast

    found: dict[str, int] = {}
    for top in ("src", "bench", "tests"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Engine":
                    name = str(path.relative_to(root))
                    found[name] = found.get(name, 0) + 1
    return found


def test_one_engine_assembly():
    """Every engine is built by gpu_worker/assembly/build.py (build_engine, BuiltEngine.fresh_engine): the service,
    the benches and the tests alike; only the Engine class's own unit tests (ENGINE_UNIT_TESTS) construct one."""
    found = engine_constructions()
    assert found.get(ENGINE_BUILDER), "build.py builds no Engine: this check would prove nothing"
    others = {name: n for name, n in found.items() if name != ENGINE_BUILDER and name not in ENGINE_UNIT_TESTS}
    assert not others, (f"Engine(...) constructed outside build_engine: {others}; build it with "
                        f"gpu_worker.api.build_engine(spec) (tests: tests/built_engines.py)")
    stale = sorted(set(ENGINE_UNIT_TESTS) - set(found))
    assert not stale, f"allow-listed files that construct no Engine any more (drop them from the list): {stale}"


def test_the_engine_check_sees_a_hand_assembly(tmp_path):
    """The scan finds `Engine(...)` however it is spelled (a name, an attribute), in each of the three trees."""
    for top, text in (("src", "engine = Engine(model, EngineConfig())\n"),
                      ("bench", "import ftexpert.gpu_worker.engine as e\nx = e.Engine(m)\n"),
                      ("tests", "def f(m):\n    return [Engine(m), Engine(m, None)]\n")):
        (tmp_path / top).mkdir()
        (tmp_path / top / "mod.py").write_text(text)
    assert engine_constructions(tmp_path) == {"src/mod.py": 1, "bench/mod.py": 1, "tests/mod.py": 2}
