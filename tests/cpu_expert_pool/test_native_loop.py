"""The worker's C hot loop (cpu_expert_pool/native_loop.py, native/serve_loop.c) in one process: it answers
requests like the float32 reference, in order over both slots, leaves the ones Python must answer
untouched, counts what the Python loop counts, and returns at its deadline or when idle. A split expert (a
prefix of its channels) is computed as asked, never outlives its request, and an invalid one is answered
by the Python path; the worker's whole loop (cpu_busy_loop, C or Python) is run in a thread for that."""
from __future__ import annotations

import os
import queue
import threading
import time
import types
import uuid

import numpy as np
import pytest
import torch

from ftexpert.proto.cpu_channel import CpuPoolClient, WorkerError
from ftexpert.proto.shm_layout import create_worker_channel
from ftexpert.cpu_expert_pool.channel import WorkerChannel
from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel
from ftexpert.cpu_expert_pool.native.build import try_load_native
from ftexpert.cpu_expert_pool.native_loop import SERVE_DEADLINE, SERVE_IDLE, SERVE_PYTHON, native_loop_wanted
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.proto.expert_owners import ExpertSplit
from ftexpert.cpu_expert_pool.worker import CpuWorker, Stop, WorkerOptions, WorkerSettings, WorkerStats, cpu_busy_loop
from ftexpert.proto.expert_store import ExpertStore
from ftexpert.proto.shm_layout import STATUS_BAD_REQUEST
from tests.cpu_expert_pool.cpu_pool_util import random_store

NATIVE, WHY_NOT = try_load_native()
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"compiled kernel unavailable: {WHY_NOT}")

H, I, E, L = 64, 32, 6, 3
I_WIDE = 128                            # the split tests' store: room for split limits (multiples of 32 below I)
T_MAX, MAX_TRIPLES = 8, 16
BF16_PATH_TOL = 4 * 2.0 ** -8           # as tests/cpu_expert_pool/test_cpu_pool_kernel.py: a few bf16 roundings of the scale
FAR_S = 5.0


def _rig(intermediate: int):
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = random_store(f"ft-test-nls-{tag}", num_layers=L, num_experts=E, hidden=H, intermediate=intermediate,
                         config_hash="n")
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


@pytest.fixture
def rig():
    yield from _rig(I)


@pytest.fixture
def wide_rig():
    yield from _rig(I_WIDE)


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


def _ring_raw(wc: WorkerChannel, slot: int, layer: int, num_tokens: int, num_triples: int, split_expert: int = -1,
              split_limit: int = 0) -> int:
    """Write a request line as a client would, without the client's checks, and ring it."""
    views = wc.views
    seq = int(views.request_seq[0]) + 1
    line = views.slots[slot].request
    line["layer"], line["num_tokens"], line["num_triples"] = layer, num_tokens, num_triples
    line["split_limit"], line["split_expert"], line["seq"] = split_limit, split_expert, seq
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


# ---------------------------------------------------------------------------------------------
# Split expert
# ---------------------------------------------------------------------------------------------
def split_reference(store: ExpertStore, layer: int, hidden, tok, exp, w, split_expert: int, split_limit: int):
    """fp32 reference with expert split_expert cut to channels [0, split_limit) (gate/up rows, down columns)."""
    inter = store.shape.intermediate
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for k in range(tok.numel()):
        t, e = int(tok[k]), int(exp[k])
        c = split_limit if split_limit and e == split_expert else inter
        w13, w2 = (v.float() for v in store.expert_views(layer, e))
        x = hidden[t].float()
        out[t] += float(w[k]) * (torch.nn.functional.silu(w13[:c] @ x) * (w13[inter:inter + c] @ x)) @ w2[:, :c].T
    return out


def split_batch(seed: int, split_expert: int):
    """T_MAX tokens, top-2: the split expert on 5 tokens (the AMX path where AMX runs), whole experts beside it."""
    hidden, (tok, exp, w) = triples(T_MAX, 2, seed=seed)
    exp = exp.clone()
    exp[exp == split_expert] = (split_expert + 1) % E        # keep the per-token experts distinct ...
    for t in range(5):
        if exp[2 * t + 1] != split_expert:
            exp[2 * t] = split_expert                         # ... while routing tokens 0-4 to it
    assert int((exp == split_expert).sum()) == 5
    return hidden, (tok, exp, w)


BAD_SPLITS = {"limit-not-a-multiple": (1, 48), "limit-at-I": (1, I_WIDE), "limit-negative": (1, -32),
              "expert-out-of-range": (E, 32), "expert-negative": (-1, 32)}


def test_split_expert_then_a_whole_request_on_the_same_slot(wide_rig):
    store, wc, client, kernel = wide_rig
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    hidden, (tok, exp, w) = split_batch(seed=3, split_expert=2)
    whole = reference_moe_layer(store, 0, hidden, tok, exp, w)
    line = wc.views.slots[0].request
    client.submit(0, hidden, (tok, exp, w), split_expert=2, split_limit=64)
    assert (int(line["split_limit"][0]), int(line["split_expert"][0])) == (64, 2)
    assert loop.run(deadline(), hot_ns=0, last_work_ns=0)[0] == SERVE_IDLE
    out = client.wait(0, deadline_s=FAR_S).clone()
    ref = split_reference(store, 0, hidden, tok, exp, w, 2, 64)
    assert rel_err(out, ref) <= BF16_PATH_TOL < rel_err(out, whole) / 4
    stats = WorkerStats()
    loop.drain_stats(stats)
    used = set(exp.tolist())
    assert stats.weight_bytes == 3 * H * 2 * (64 + I_WIDE * (len(used) - 1))
    # Layer 2 is slot 0 again: no split asked, so none may be left from the request before.
    client.submit(2, hidden, (tok, exp, w))
    assert (int(line["split_limit"][0]), int(line["split_expert"][0])) == (0, -1)
    assert loop.run(deadline(), hot_ns=0, last_work_ns=0)[0] == SERVE_IDLE
    out = client.wait(2, deadline_s=FAR_S)
    assert rel_err(out, reference_moe_layer(store, 2, hidden, tok, exp, w)) <= BF16_PATH_TOL
    loop.drain_stats(stats)
    assert stats.weight_bytes == 3 * H * 2 * (64 + I_WIDE * (len(used) - 1)) + 3 * H * 2 * I_WIDE * len(used)


def test_zero_split_limit_means_no_split_whatever_the_expert_field_holds(wide_rig):
    """A writer that stores num_triples as 64 bits at offset 16 leaves split_limit 0; split_expert may hold
    anything (a stale value, garbage)."""
    store, wc, _, kernel = wide_rig
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    hidden, (tok, exp, w) = split_batch(seed=4, split_expert=1)
    slot = wc.views.slots[1]
    slot.hidden[:T_MAX] = hidden.view(torch.int16).numpy()
    slot.token_idx[:len(tok)], slot.expert_id[:len(tok)], slot.weight[:len(tok)] = tok.numpy(), exp.numpy(), w.numpy()
    for junk in (1, E + 7, -5):
        _ring_raw(wc, 1, 1, T_MAX, len(tok), split_expert=junk, split_limit=0)
        assert loop.run(deadline(), hot_ns=0, last_work_ns=0)[0] == SERVE_IDLE
        out = torch.from_numpy(slot.out[:T_MAX])
        assert rel_err(out, reference_moe_layer(store, 1, hidden, tok, exp, w)) <= BF16_PATH_TOL


@pytest.mark.parametrize("bad", list(BAD_SPLITS))
def test_an_invalid_split_is_left_to_python(wide_rig, bad):
    _, wc, _, kernel = wide_rig
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    slots = wc.views.slots
    slots[0].token_idx[:2], slots[0].expert_id[:2], slots[0].weight[:2] = 0, (1, 2), 0.5
    split_expert, split_limit = BAD_SPLITS[bad]
    for n in (2, 0):                                  # with triples, and with none (no kernel call at all)
        seq = _ring_raw(wc, 0, 0, 1, n, split_expert=split_expert, split_limit=split_limit)
        code, _ = loop.run(deadline(), hot_ns=int(1e9), last_work_ns=time.monotonic_ns())
        assert code == SERVE_PYTHON and wc.done == seq - 1 and int(slots[0].response["seq"][0]) != seq
        req = wc.next_request()
        assert req is not None and (req.seq, req.split_expert, req.split_limit) == (seq, split_expert, split_limit)
        wc.complete(req, 0)


@pytest.mark.parametrize("loop", ["native", "python"])
def test_worker_loop_serves_splits_and_answers_a_bad_split_with_an_error(wide_rig, monkeypatch, caplog, loop):
    """cpu_busy_loop as the worker process runs it (FT_WORKER_LOOP: C loop or Python loop), in a thread: a
    split, then the same slot without one, then invalid splits (bad request, logged), and it keeps serving."""
    store, wc, client, _ = wide_rig
    monkeypatch.setenv("FT_WORKER_LOOP", loop)
    options = WorkerOptions(store.name, wc.name, settings=WorkerSettings(kernel="native", num_threads=1, hot_ms=5.0),
                            pin_threads=False, warmup=False)
    placement = types.SimpleNamespace(num_threads=1, compute_cpus=(0,))
    worker = CpuWorker(options, placement, store, wc)
    inbox: queue.Queue = queue.Queue()
    thread = threading.Thread(target=cpu_busy_loop, args=(worker, inbox), daemon=True)
    thread.start()
    try:
        hidden, (tok, exp, w) = split_batch(seed=5, split_expert=3)
        for layer, split_limit in ((1, 96), (1, 0), (1, 32), (1, 0)):      # slot 1 each time
            out = client.call(layer, hidden, (tok, exp, w), deadline_s=FAR_S, split_expert=3, split_limit=split_limit)
            ref = split_reference(store, layer, hidden, tok, exp, w, 3, split_limit)
            assert rel_err(out, ref) <= BF16_PATH_TOL, (layer, split_limit)
        client.call(0, hidden, (tok, exp, w), deadline_s=FAR_S)       # slot 0 holds this batch now
        views = wc.views
        for split_expert, split_limit in BAD_SPLITS.values():  # the client refuses most: ring the line raw
            seq = _ring_raw(wc, 0, 0, T_MAX, len(tok), split_expert=split_expert, split_limit=split_limit)
            give_up = time.monotonic() + FAR_S
            while int(views.done_seq[0]) < seq and time.monotonic() < give_up:
                time.sleep(0.0005)
            response = views.slots[0].response
            assert (int(response["seq"][0]), int(response["status"][0])) == (seq, STATUS_BAD_REQUEST)
        with pytest.raises(WorkerError, match="bad request"):   # and through the client: I_WIDE is no limit
            client.call(0, hidden, (tok, exp, w), deadline_s=FAR_S, split_expert=1, split_limit=I_WIDE)
        out = client.call(0, hidden, (tok, exp, w), deadline_s=FAR_S)
        assert rel_err(out, reference_moe_layer(store, 0, hidden, tok, exp, w)) <= BF16_PATH_TOL
    finally:
        inbox.put(Stop("test over"))
        thread.join(timeout=FAR_S)
    assert not thread.is_alive()
    assert worker.stats.requests == 7 + len(BAD_SPLITS) and worker.stats.errors == 1 + len(BAD_SPLITS)
    assert worker.kernel.name.startswith("native-") and (worker._loop is not None) == (loop == "native")
    for named in ("split_limit 48 is not a multiple of 32", f"split_limit {I_WIDE} is outside", "split_limit -32",
                  f"split_expert {E} is outside", "split_expert -1 is outside"):
        assert named in caplog.text                       # the log line says what was wrong
