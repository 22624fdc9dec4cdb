"""The worker's C hot loop (cpu_expert_pool/native_loop.py, native/serve_loop.c) in one process: it answers
requests like the float32 reference, in order over both slots, leaves the ones Python must answer
untouched, counts what the Python loop counts, and returns at its deadline or when idle."""
from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch

from cpu_expert_pool.channel import CpuPoolClient, WorkerChannel, create_worker_channel
from cpu_expert_pool.expert_kernel import ExpertKernel
from cpu_expert_pool.native.build import try_load_native
from cpu_expert_pool.native_loop import SERVE_DEADLINE, SERVE_IDLE, SERVE_PYTHON, native_loop_wanted
from cpu_expert_pool.reference import reference_moe_layer
from cpu_expert_pool.split import ExpertSplit
from cpu_expert_pool.worker import WorkerStats
from tests.cpu_pool_util import random_store

NATIVE, WHY_NOT = try_load_native()
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"compiled kernel unavailable: {WHY_NOT}")

H, I, E, L = 64, 32, 6, 3
T_MAX, MAX_TRIPLES = 8, 16
BF16_PATH_TOL = 4 * 2.0 ** -8           # as tests/test_cpu_pool_kernel.py: a few bf16 roundings of the scale
FAR_S = 5.0


@pytest.fixture
def rig():
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = random_store(f"ft-test-nls-{tag}", num_layers=L, num_experts=E, hidden=H, intermediate=I, config_hash="n")
    seg = create_worker_channel(f"ft-test-nl-{tag}", t_max=T_MAX, hidden=H, max_triples=MAX_TRIPLES)
    wc = WorkerChannel(seg.name)
    wc.start()
    wc.serve()
    client = CpuPoolClient(seg.name)
    client.wait_for_worker(timeout_s=FAR_S)
    kernel = ExpertKernel(store, kernel="native", num_threads=1)
    yield store, wc, client, kernel
    client.close()
    wc.close()
    seg.close()
    seg.unlink()
    store.close()
    store.unlink()


def triples(num_tokens: int, per_token: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(per_token)
    expert_id = torch.stack([torch.randperm(E, generator=g)[:per_token] for _ in range(num_tokens)]).flatten().int()
    weight = torch.rand(num_tokens * per_token, generator=g)
    return hidden, (token_idx, expert_id, weight)


def deadline(seconds: float = FAR_S) -> int:
    return time.monotonic_ns() + int(seconds * 1e9)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def test_answers_both_slots_in_order_like_the_reference(rig):
    store, wc, client, kernel = rig
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    batches = {layer: triples(3 + layer, 2, seed=layer) for layer in (1, 2)}     # slots 1 and 0
    seqs = [client.submit(layer, hidden, trip) for layer, (hidden, trip) in batches.items()]
    code, last = loop.run(deadline(), hot_ns=0, last_work_ns=0)
    assert code == SERVE_IDLE and last > 0
    assert wc.done == seqs[-1] == int(wc.views.done_seq[0])
    for layer, (hidden, (tok, exp, w)) in batches.items():
        out = client.wait(layer, deadline_s=FAR_S).clone()
        ref = reference_moe_layer(store, layer, hidden, tok, exp, w)
        assert rel_err(out, ref) <= BF16_PATH_TOL
        assert client.last_compute_ns(layer) > 0
    stats = WorkerStats()
    loop.drain_stats(stats)
    assert (stats.requests, stats.tokens, stats.triples) == (2, 4 + 5, 2 * (4 + 5))
    expected_experts = sum(len(set(b[1][1].tolist())) for b in batches.values())
    assert stats.expert_calls == expected_experts
    assert stats.weight_bytes == expected_experts * store.expert_bytes
    assert stats.compute_ns > 0 and stats.foreign_triples == 0
    loop.drain_stats(stats)                                         # drained: nothing added twice
    assert stats.requests == 2


def test_zero_triples_zero_the_partial_sums(rig):
    _, wc, client, kernel = rig
    wc.views.slots[0].out[:] = np.nan
    client.submit(0, torch.ones(2, H), (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32)))
    code, _ = kernel.serve_loop(wc, split=None, worker_index=0).run(deadline(), hot_ns=0, last_work_ns=0)
    assert code == SERVE_IDLE
    out = client.wait(0, deadline_s=FAR_S)
    assert out.shape == (2, H) and bool((out == 0).all())


def _ring_raw(wc: WorkerChannel, slot: int, layer: int, num_tokens: int, num_triples: int) -> int:
    """Write a request line as a client would, without the client's checks, and ring it."""
    views = wc.views
    seq = int(views.request_seq[0]) + 1
    line = views.slots[slot].request
    line["layer"], line["num_tokens"], line["num_triples"], line["seq"] = layer, num_tokens, num_triples, seq
    views.request_seq[0] = seq
    return seq


@pytest.mark.parametrize("bad", ["too-many-triples", "layer-out-of-range", "expert-out-of-range"])
def test_requests_python_must_answer_are_left_untouched(rig, bad):
    """C returns SERVE_PYTHON without answering; the Python path then finds the same request next."""
    store, wc, _, kernel = rig
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    slots = wc.views.slots
    slots[0].token_idx[:2], slots[0].expert_id[:2], slots[0].weight[:2] = 0, (1, E if bad == "expert-out-of-range" else 2), 0.5
    args = {"too-many-triples": (0, 1, MAX_TRIPLES + 1), "layer-out-of-range": (L, 1, 2),
            "expert-out-of-range": (0, 1, 2)}[bad]
    seq = _ring_raw(wc, 0, *args)
    before = int(wc.views.done_seq[0])
    code, _ = loop.run(deadline(), hot_ns=int(1e9), last_work_ns=time.monotonic_ns())
    assert code == SERVE_PYTHON
    assert wc.done == before == int(wc.views.done_seq[0]) == seq - 1
    assert int(slots[0].response["seq"][0]) != seq
    req = wc.next_request()
    assert req is not None and req.seq == seq
    stats = WorkerStats()
    loop.drain_stats(stats)
    assert stats.requests == 0


def test_returns_at_its_deadline_while_hot_and_when_idle(rig):
    _, wc, _, kernel = rig
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    t0 = time.monotonic_ns()
    code, last = loop.run(t0 + 3_000_000, hot_ns=int(10e9), last_work_ns=t0)     # hot, no request: spins
    waited = time.monotonic_ns() - t0
    assert code == SERVE_DEADLINE and last == t0 and waited >= 3_000_000
    t1 = time.monotonic_ns()
    code, _ = loop.run(deadline(), hot_ns=2_000_000, last_work_ns=t1)              # cold after 2 ms idle
    assert code == SERVE_IDLE and time.monotonic_ns() - t1 >= 2_000_000


def test_counts_foreign_triples_against_the_split(rig):
    store, wc, client, kernel = rig
    owner = np.zeros((L, E), dtype=np.int16)
    owner[1, 3:] = 1                                             # experts 3.. of layer 1 belong to worker 1
    loop = kernel.serve_loop(wc, split=ExpertSplit(owner, 2), worker_index=0)
    hidden, (tok, exp, w) = triples(4, 3, seed=7)
    client.submit(1, hidden, (tok, exp, w))
    loop.run(deadline(), hot_ns=0, last_work_ns=0)
    client.wait(1, deadline_s=FAR_S)
    stats = WorkerStats()
    loop.drain_stats(stats)
    assert stats.foreign_triples == int((exp >= 3).sum()) > 0


def test_loop_choice_from_the_environment(monkeypatch):
    monkeypatch.setenv("FT_WORKER_LOOP", "python")
    assert native_loop_wanted() is False
    monkeypatch.setenv("FT_WORKER_LOOP", "native")
    assert native_loop_wanted() is True
    monkeypatch.setenv("FT_WORKER_LOOP", "fast")
    with pytest.raises(ValueError, match="native or python"):
        native_loop_wanted()
