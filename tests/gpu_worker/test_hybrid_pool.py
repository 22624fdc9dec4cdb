"""`CpuPool` on its own, attached to workers someone else started (as `ft serve`'s coordinator does):
triples split by owner and joined, a late worker killed and its share handed back, re-admission."""
from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest
import torch

from ftexpert.proto.shm_layout import create_worker_channel
from ftexpert.cpu_expert_pool.api import CpuWorkerProc
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.gpu_worker.backends.hybrid import CpuPool
from ftexpert.proto.expert_store import ExpertStore

H, I, E, L, T = 32, 16, 8, 2, 3
WORKER_ARGS = ["--threads", "1", "--no-pin", "--hot-ms", "1"]
START_TIMEOUT_S = 60.0


@pytest.fixture
def store():
    s = ExpertStore.create(f"ft-test-hpool-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=L, num_experts=E,
                           hidden=H, intermediate=I, dtype=torch.float32, config_hash="hpool")
    g = torch.Generator().manual_seed(3)
    for layer in range(L):
        s.write_layer(layer, torch.randn(E, s.shape.expert_numel, generator=g) / H ** 0.5)
    s.mark_ready()
    yield s
    s.close()
    s.unlink()


@pytest.fixture
def workers(store, tmp_path):
    """Two channels and two standalone workers (worker i owns experts [4i, 4i+4) of every layer)."""
    names = [f"{store.name}.cpu{i}" for i in range(2)]
    segs = [create_worker_channel(n, t_max=T, hidden=H, max_triples=T * 4, hidden_dtype="float32") for n in names]
    procs = []

    def start(i: int) -> CpuWorkerProc:
        proc = CpuWorkerProc(store_name=store.name, channel_name=names[i], worker_index=i, num_workers=2,
                             extra_args=WORKER_ARGS, log_path=tmp_path / f"w{i}-{len(procs)}.log").start()
        procs.append(proc)
        return proc

    first = [start(0), start(1)]
    yield names, first, start
    for proc in procs:
        proc.stop(timeout_s=5)
    for seg in segs:
        seg.close()
        seg.unlink()


def triples(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    token = np.repeat(np.arange(T, dtype=np.int32), 2)
    expert = np.array([0, 5, 3, 7, 1, 2], dtype=np.int32)          # both workers get triples
    weight = torch.rand(2 * T, generator=g).numpy()
    return hidden, token, expert, weight


def test_attached_pool_splits_joins_and_survives_a_late_worker(store, workers):
    names, procs, start = workers
    pool = CpuPool.attach(store, names, deadline_s=5.0, readmit_poll_s=0.0, ready_timeout_s=START_TIMEOUT_S)
    out = torch.empty(T, H)
    try:
        hidden, token, expert, weight = triples(1)
        shares = pool.submit(0, hidden, token, expert, weight)
        assert [s.member.name for s in shares] == ["cpu0", "cpu1"] and [s.num_experts for s in shares] == [4, 2]
        assert pool.join(0, shares, out=out) == []
        ref = reference_moe_layer(store, 0, hidden, torch.from_numpy(token), torch.from_numpy(expert),
                                  torch.from_numpy(weight))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

        # the coordinator's split: all of layer 0's experts to cpu0, same sum
        pool.set_shares({"cpu0": 1.0, "cpu1": 0.0})
        shares = pool.submit(0, hidden, token, expert, weight)
        assert [s.member.name for s in shares] == ["cpu0"] and shares[0].rows.size == len(token)
        assert pool.join(0, shares, out=out) == []
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="unknown worker"):
            pool.set_shares({"numa7": 1.0})
        pool.set_shares({"cpu0": 1.0, "cpu1": 1.0})                    # back to halves

        # worker 1 stops: its share comes back as failed within the deadline, the process is killed
        pool.deadline_s = 0.5
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        shares = pool.submit(1, hidden, token, expert, weight)
        failed = pool.join(1, shares, out=out)
        assert time.monotonic() - t0 < 0.5 + 2.0
        assert [s.member.name for s in failed] == ["cpu1"] and failed[0].rows.tolist() == [1, 3]
        assert not pool.all_serving and pool.members[1].kills_total == 1
        assert procs[1].wait(timeout_s=10) == -signal.SIGKILL
        only0 = np.array([0, 2, 4, 5])                               # the triples worker 0 computed
        ref0 = reference_moe_layer(store, 1, hidden, *(torch.from_numpy(a[only0]) for a in (token, expert, weight)))
        torch.testing.assert_close(out, ref0, rtol=1e-5, atol=1e-6)

        # nothing is re-admitted until a worker serves the channel again; then it is
        assert pool.poll() == [] and not pool.all_serving
        replacement = start(1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not pool.all_serving:
            assert time.monotonic() < deadline, "the restarted worker was never re-admitted"
            pool.poll()
            time.sleep(0.02)
        assert pool.members[1].pid == replacement.pid and pool.members[1].readmissions_total == 1
        pool.deadline_s = 5.0
        shares = pool.submit(0, hidden, token, expert, weight)
        assert pool.join(0, shares, out=out) == []
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    finally:
        pool.close()
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names), "an attached pool leaves the channels alone"
