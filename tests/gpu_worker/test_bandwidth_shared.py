"""`shared_bandwidth` (gpu_worker/backends/hybrid/bandwidth.py) on the CPU device: the copy loop on its thread and
real `ft worker cpu` processes at the same time, the window bookkeeping, and its failures."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from ftexpert.gpu_worker.backends.hybrid import bandwidth
from ftexpert.gpu_worker.backends.hybrid.bandwidth import bench_store, shared_bandwidth
from ftexpert.proto.shm_segment import shm_path

TOP_K = 2
WORKER_FLAGS = ["--threads", "1", "--log-level", "WARNING"]
CPU = torch.device("cpu")


@pytest.fixture
def store():
    s = bench_store(64, 64, torch.float32, 2 * 2**20, min_experts=4 * TOP_K)     # 48 KB experts, 2 MiB
    yield s
    s.close()
    s.unlink()


@pytest.fixture
def procs(monkeypatch):
    """Every worker process shared_bandwidth starts."""
    started: list[bandwidth.CpuWorkerProc] = []

    class Recorded(bandwidth.CpuWorkerProc):
        def start(self):
            started.append(self)
            return super().start()

    monkeypatch.setattr(bandwidth, "CpuWorkerProc", Recorded)
    return started


def assert_nothing_left(store, procs) -> None:
    assert procs and not any(p.alive() for p in procs)
    assert not [t for t in threading.enumerate() if t.name == "ft-bench-bw-copy"]
    assert not os.path.exists(shm_path(f"{store.name}.bw0"))          # the channel is unlinked


def test_shared_figures_are_consistent_with_their_window(store, procs, monkeypatch):
    samples = []                                 # (bytes a sample, [seconds]) as _measurement gets them
    real = bandwidth._measurement

    def spy(nbytes, seconds):
        samples.append((nbytes, list(seconds)))
        return real(nbytes, seconds)

    monkeypatch.setattr(bandwidth, "_measurement", spy)
    r = shared_bandwidth(store, CPU, top_k=TOP_K, calls=20, num_workers=1, worker_flags=WORKER_FLAGS)
    (batch_bytes, copy_s), (call_bytes, cpu_s), (kernel_bytes, kernel_s) = samples
    assert batch_bytes == bandwidth.COPY_BATCH * store.expert_bytes and call_bytes == TOP_K * store.expert_bytes
    assert r.pcie.gb_s > 0 and r.cpu.gb_s > 0 and r.combined_gb_s > 0
    assert r.window_s >= bandwidth.SHARED_WINDOW_MIN_S
    # the calls make the window; the batches counted lie inside it, one after another on one thread
    assert r.cpu.calls == len(cpu_s) >= 20 and r.cpu_bytes == r.cpu.calls * call_bytes
    assert sum(cpu_s) <= r.window_s
    assert r.pcie.calls == len(copy_s) >= bandwidth.MIN_SHARED_SAMPLES
    assert sum(copy_s) <= r.window_s + 1e-3                # the copy window opens a moment before the calls
    # bytes copied inside the window: the whole batches, plus at most the two cut by its edges
    assert r.pcie.calls * batch_bytes <= r.pcie_bytes <= (r.pcie.calls + 2) * batch_bytes
    assert r.combined_gb_s == pytest.approx((r.pcie_bytes / r.copy_window_s + r.cpu_bytes / r.window_s) / 1e9)
    # the workers' own kernel time of the same calls: inside each call's round trip
    assert kernel_bytes == call_bytes and len(kernel_s) == len(cpu_s)
    assert all(0 < k <= c for k, c in zip(kernel_s, cpu_s)) and r.cpu_kernel.gb_s >= r.cpu.gb_s
    assert r.fetch_fraction == pytest.approx(r.pcie.gb_s / (r.pcie.gb_s + r.cpu.gb_s))
    assert_nothing_left(store, procs)


def test_a_window_too_short_for_the_copies_fails_clearly_and_cleans_up(store, procs, monkeypatch):
    monkeypatch.setattr(bandwidth, "SHARED_WINDOW_MIN_S", 0.0)
    monkeypatch.setattr(bandwidth, "COPY_BATCH", 20_000)            # ~1 GB a batch: longer than 3 calls
    with pytest.raises(RuntimeError, match=r"only \d copy batches .* inside the .* CPU window of 3 calls"):
        shared_bandwidth(store, CPU, top_k=TOP_K, calls=3, num_workers=1, worker_flags=WORKER_FLAGS)
    assert_nothing_left(store, procs)


def test_a_failing_copy_loop_is_reported_and_cleans_up(store, procs, monkeypatch):
    def broken(self):
        raise OSError("copy engine on fire")

    monkeypatch.setattr(bandwidth._CopyLoop, "_run_host", broken)
    with pytest.raises(RuntimeError, match="copy loop of the shared measurement failed.*copy engine on fire"):
        shared_bandwidth(store, CPU, top_k=TOP_K, calls=5, num_workers=1, worker_flags=WORKER_FLAGS)
    assert_nothing_left(store, procs)


def test_too_few_calls_is_refused_before_any_worker_starts(store, procs):
    with pytest.raises(ValueError, match="at least 3 CPU calls"):
        shared_bandwidth(store, CPU, top_k=TOP_K, calls=2, num_workers=1, worker_flags=WORKER_FLAGS)
    assert not procs
