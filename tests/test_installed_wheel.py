"""The installed package, not the checkout: the project's wheel installed (non-editable) into a fresh virtual
environment beside the newest `transformers` and Hugging Face's `kernels`, then used from the repository root
and from an unrelated folder.

A top-level package with a generic name (`kernels`, `proto`) shadows or overwrites another distribution's;
the one import root `ftexpert` is what keeps both programs working in one environment. This needs the
package registries (pip resolves the wheel's dependencies) and takes ~2-4 minutes on a 2-core machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 1200

# package data the service reads at run time, each a path inside the wheel
PACKAGE_DATA = (
    "ftexpert/cpu_expert_pool/native/expert_ffn.c",        # the CPU expert kernel, compiled at first use
    "ftexpert/cpu_expert_pool/native/quant_ffn.c",
    "ftexpert/cpu_expert_pool/native/expert_dots.h",
    "ftexpert/proto/control.proto",                        # the wire contract the descriptors come from
    "ftexpert/proto/grpc_health/v1/health.proto",
    "ftexpert/gpu_worker/checkpoint/data/default-moe/config.json",           # the embedded default model
    "ftexpert/gpu_worker/checkpoint/data/default-moe/model.safetensors",
    "ftexpert/gpu_worker/checkpoint/data/default-moe/tokenizer.json",
    "ftexpert/workload/data/kjv.txt.xz",                   # the bundled corpus
    "ftexpert/workload/data/qwen3-30b-a3b-routing.trace",  # the kept routing trace
)


def run(argv, *, cwd, env=None, timeout=INSTALL_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy without build outputs: setuptools' build/ folder keeps modules the tree no longer has
    tree = tmp_path_factory.mktemp("tree") / "src-tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                              ".whl", ".venv", "out", ".pytest_cache", ".hypothesis"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, tree], cwd=out)
    (path,) = out.glob("ft_expert_service-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv: the CPU torch this interpreter runs (the README's first step on a machine without a GPU),
    then the wheel with its dependencies and transformers, each at the newest release its pins allow."""
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", root], cwd=root)
    py = root / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", f"torch=={torch.__version__}"], cwd=root)
    run([py, "-m", "pip", "install", "-q", wheel, "transformers", "kernels"], cwd=root)
    return root


def clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_wheel_carries_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in PACKAGE_DATA if p not in names]
    assert not missing, f"the wheel lacks its package data: {missing}"
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert tops == {"ftexpert"}, f"the wheel installs top-level names besides ftexpert: {sorted(tops)}"
    source = {str(p.relative_to(REPO / "src")) for p in (REPO / "src" / "ftexpert").rglob("*.py")}
    packed = {n for n in names if n.endswith(".py")}
    assert packed == source, f"modules only in the wheel: {sorted(packed - source)}; only in src: {sorted(source - packed)}"


@pytest.mark.parametrize("where", ["repo-root", "elsewhere"])
def test_installed_wheel_beside_transformers_and_hf_kernels(venv, where, tmp_path):
    cwd = REPO if where == "repo-root" else tmp_path
    env = clean_env(venv)
    py = venv / "bin" / "python"
    probe = ("import json, ftexpert, kernels, transformers\n"
             "from transformers import Qwen3MoeForCausalLM\n"
             "from kernels import get_kernel\n"        # Hugging Face's kernels, not a shadow of it
             "print(json.dumps({'ftexpert': ftexpert.__file__, 'kernels': kernels.__file__,"
             " 'model': Qwen3MoeForCausalLM.__name__}))")
    found = json.loads(run([py, "-c", probe], cwd=cwd, env=env, timeout=300).stdout.strip().splitlines()[-1])
    site = str(venv)
    assert found["ftexpert"].startswith(site), f"ftexpert came from {found['ftexpert']}, not the installed wheel"
    assert found["kernels"].startswith(site), f"kernels came from {found['kernels']}, not Hugging Face's package"
    assert found["model"] == "Qwen3MoeForCausalLM"

    gen = run([venv / "bin" / "ft", "generate", "--prompt", "And God said", "--max-new-tokens", "8", "--json"],
              cwd=cwd, env=env, timeout=300)
    answer = json.loads(gen.stdout.strip().splitlines()[-1])
    assert len(answer["token_ids"]) == 8 and answer["text"].strip(), answer
    assert "default-moe" in answer["model"] and answer["model"].split()[-1].startswith(site), answer["model"]
