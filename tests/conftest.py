"""Test set-up shared by every test module.

Without a GPU, Triton kernels run in the Triton interpreter, which must be switched on before any
kernel is defined: that is why this happens here, before test modules import the kernels.
"""
import os

import pytest
import torch
from hypothesis import settings

# CI runs the property tests with a fixed seed: a failure there reproduces on the next run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The device the Triton kernels run on in the lockstep tests: the GPU where there is one,
# else CPU tensors through the interpreter.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test starts with the process's torch thread count: building a hybrid backend in-process sets it (the
    GPU worker's engine thread count), and the CPU's float sums, hence a tiny model's greedy text, depend on it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def no_tf32():
    """Exact float32 matmuls on the GPU for tests that compare tokens with the CPU."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def assert_compile_check(module: str) -> None:
    """Run `python -m <module>` (a kernels compile_check) without the interpreter: Triton's real compiler
    (MLIR, LLVM, ptxas) on every case, which catches what only the interpreter accepts; skips where this
    triton cannot compile ahead of time."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "0 failed" in proc.stdout
