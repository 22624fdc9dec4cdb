"""The hot-path channel in one process: layout contract, request/response protocol, double buffering,
restart semantics, the split-expert fields of the request line, the worker's idle policy."""
from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid

import pytest
import torch

from ftexpert.cpu_expert_pool import channel as ch
from ftexpert.proto.cpu_channel import CpuPoolClient, WorkerDead, WorkerError, WorkerTimeout
from ftexpert.proto.shm_layout import create_worker_channel
from ftexpert.cpu_expert_pool.channel import IdlePolicy, IdleWaiter, WorkerChannel
from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.proto import shm_layout as sl
from ftexpert.proto import shm_segment
from ftexpert.proto.expert_store import ExpertStore
from tests.cpu_expert_pool.cpu_pool_util import random_store

H, I, E, L = 64, 32, 4, 3
T_MAX, MAX_TRIPLES = 8, 16


@pytest.fixture
def names():
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store_name, chan_name = f"ft-test-chs-{tag}", f"ft-test-ch-{tag}"
    yield store_name, chan_name
    for name in (store_name, chan_name):
        try:
            os.unlink(os.path.join(shm_segment.SHM_DIR, name))
        except FileNotFoundError:
            pass


@pytest.fixture
def store(names):
    s = random_store(names[0], num_layers=L, num_experts=E, hidden=H, intermediate=I, config_hash="c")
    yield s
    s.close()


@pytest.fixture
def chan(names):
    seg = create_worker_channel(names[1], t_max=T_MAX, hidden=H, max_triples=MAX_TRIPLES)
    yield names[1]
    seg.close()


class ThreadWorker:
    """A WorkerChannel served by a thread with the real torch kernel (stands in for the process)."""

    def __init__(self, chan_name: str, store: ExpertStore):
        self.wc = WorkerChannel(chan_name)
        self.kernel = ExpertKernel(store, kernel="torch", num_threads=1)
        self.stop_event = threading.Event()
        self.hold = threading.Event()        # set: take requests but never answer (a hang)
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def start(self) -> "ThreadWorker":
        self.wc.start()
        self.wc.serve()
        self.thread.start()
        return self

    def loop(self) -> None:
        while not self.stop_event.is_set():
            if self.hold.is_set():
                time.sleep(0.001)
                continue
            req = self.wc.next_request()
            if req is None:
                time.sleep(0)
                continue
            try:
                self.kernel(req.layer, req.hidden, req.token_idx, req.expert_id, req.weight, req.out,
                            req.split_expert, req.split_limit)
                status = sl.STATUS_OK
            except ValueError:
                status = sl.STATUS_BAD_REQUEST
            self.wc.complete(req, status, num_experts=1, compute_ns=123)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join()


def batch(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(2)
    expert_id = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(num_tokens)]).flatten().int()
    weight = torch.rand(2 * num_tokens, generator=g)
    return hidden, (token_idx, expert_id, weight)


def test_layout_puts_each_counter_on_its_own_line_and_arrays_on_pages():
    layout = sl.ChannelLayout(t_max=5, hidden=72, max_triples=11, hidden_dtype="bfloat16")
    words = [sl.REQUEST_SEQ_OFFSET, sl.DONE_SEQ_OFFSET, sl.HEARTBEAT_NS_OFFSET, sl.WORKER_PID_OFFSET,
             sl.WORKER_EPOCH_OFFSET, sl.WORKER_STATE_OFFSET]
    lines = [w // sl.CACHE_LINE_BYTES for w in words]
    assert all(w % 8 == 0 for w in words) and len(set(lines)) == len(lines)
    assert words[0] >= sl.COMMON_HEADER_BYTES + sl.CHANNEL_META_CAPACITY_BYTES
    slot_lines = sl.SLOT_LINES_OFFSET + sl.NUM_SLOTS * sl.SLOT_LINES_BYTES
    assert sl.SLOT_LINES_OFFSET > max(words) and slot_lines <= sl.CONTROL_PAGE_BYTES
    spans = []
    for s in range(sl.NUM_SLOTS):
        offsets = layout.slot_offsets(s)
        assert all(off % sl.PAGE_BYTES == 0 for off in offsets.values())
        spans += sorted(offsets.values())
    assert spans == sorted(spans) and len(set(spans)) == len(spans)     # no overlap, in order
    assert layout.slot_offsets(1)["out"] + layout.out_bytes <= layout.nbytes
    assert sl.ChannelLayout.from_meta(layout.meta()) == layout


def test_round_trip_matches_the_reference(store, chan):
    worker = ThreadWorker(chan, store).start()
    client = CpuPoolClient(chan)
    assert client.pin_for_cuda() is torch.cuda.is_available()
    doorbell = client.doorbell_addresses()
    assert all(addr % sl.CACHE_LINE_BYTES == 0 for addr in doorbell.values())
    hidden_of = [client.slot_addresses(layer)["hidden"] for layer in range(4)]
    assert hidden_of[0] == hidden_of[2] != hidden_of[1] == hidden_of[3]
    assert client.wait_for_worker(timeout_s=5) == os.getpid()
    for layer in range(L):
        hidden, triples = batch(5, seed=layer)
        partial = client.call(layer, hidden, triples, deadline_s=5)
        ref = reference_moe_layer(store, layer, hidden, *triples)
        assert partial.shape == (5, H)
        torch.testing.assert_close(partial, ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
        assert client.last_compute_ns(layer) == 123
    # The published addresses are the counters themselves (what a GPU stream would write / await).
    assert ctypes.c_int64.from_address(doorbell["done_seq"]).value == L
    assert ctypes.c_int64.from_address(doorbell["request_seq"]).value == L
    worker.stop()
    client.close()


def test_double_buffering_two_layers_in_flight(store, chan):
    worker = ThreadWorker(chan, store)
    worker.hold.set()
    worker.start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    h0, t0 = batch(3, seed=10)
    h1, t1 = batch(4, seed=11)
    client.submit(0, h0, t0)
    client.submit(1, h1, t1)
    with pytest.raises(RuntimeError, match="wait\\(\\) for layer 0"):
        client.submit(2, h0, t0)                      # slot 0 is still busy
    worker.hold.clear()
    out1 = client.wait(1, deadline_s=5).clone()
    out0 = client.wait(0, deadline_s=5).clone()
    torch.testing.assert_close(out0, reference_moe_layer(store, 0, h0, *t0), rtol=0.02, atol=0.02)
    torch.testing.assert_close(out1, reference_moe_layer(store, 1, h1, *t1), rtol=0.02, atol=0.02)
    worker.stop()
    client.close()


def test_drain_waits_for_what_is_in_flight_and_frees_the_slots(store, chan):
    """CpuPoolClient.drain (for a caller that raised between submit and wait): it waits for both layers in flight and
    drops their answers (an error status too); the next submits into those slots then go through."""
    worker = ThreadWorker(chan, store).start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    h0, t0 = batch(3, seed=10)
    h1, (tok, exp, w) = batch(2, seed=11)
    exp = exp.clone()
    exp[0] = E + 3                                    # layer 1's request is answered with an error status
    client.submit(0, h0, t0)
    client.submit(1, h1, (tok, exp, w))
    with pytest.raises(RuntimeError, match="still holds"):
        client.submit(2, h0, t0)
    assert client.drain(deadline_s=5) == 2
    assert client.drain(deadline_s=5) == 0
    client.submit(2, h0, t0)                          # slot 0 again, then slot 1
    client.submit(1, h1, (tok, exp.clamp(max=E - 1), w))
    out = client.wait(2, deadline_s=5).clone()
    torch.testing.assert_close(out, reference_moe_layer(store, 2, h0, *t0), rtol=0.02, atol=0.02)
    assert client.wait(1, deadline_s=5).shape == (2, H)
    worker.stop()
    client.close()


def test_drain_of_a_hung_worker_times_out_naming_the_layer(store, chan):
    worker = ThreadWorker(chan, store)
    worker.hold.set()                                 # takes requests, never answers
    worker.start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    h0, t0 = batch(3, seed=10)
    client.submit(2, h0, t0)
    with pytest.raises(WorkerTimeout, match="layer 2 "):
        client.drain(deadline_s=0.05)
    worker.stop()
    client.close()


def test_bad_request_is_answered_with_an_error_status(store, chan):
    worker = ThreadWorker(chan, store).start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    hidden, (tok, exp, w) = batch(2, seed=1)
    exp = exp.clone()
    exp[0] = E + 3
    with pytest.raises(WorkerError, match="bad request"):
        client.call(0, hidden, (tok, exp, w), deadline_s=5)
    hidden, triples = batch(2, seed=2)                # the channel keeps working
    assert client.call(0, hidden, triples, deadline_s=5).shape == (2, H)
    with pytest.raises(ValueError, match="does not fit channel"):
        client.submit(1, torch.zeros(T_MAX + 1, H), triples)
    worker.stop()
    client.close()


def test_hang_times_out_and_a_new_worker_drops_stale_requests(store, chan):
    worker = ThreadWorker(chan, store)
    worker.hold.set()
    worker.start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    hidden, triples = batch(2, seed=3)
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout, match="did not finish layer 0"):
        client.call(0, hidden, triples, deadline_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert not client.connected
    with pytest.raises(WorkerDead, match="wait_for_worker"):
        client.submit(0, hidden, triples)
    worker.stop()
    # A replacement claims the channel: the request left in flight is dropped, a new epoch begins.
    old_epoch = worker.wc.epoch
    replacement = ThreadWorker(chan, store).start()
    assert replacement.wc.epoch == old_epoch + 1
    client.wait_for_worker(timeout_s=5)
    out = client.call(0, hidden, triples, deadline_s=5)
    torch.testing.assert_close(out, reference_moe_layer(store, 0, hidden, *triples), rtol=0.02, atol=0.02)
    replacement.stop()
    client.close()


def test_doorbell_without_a_request_line_does_not_hang_the_worker(store, chan):
    wc = WorkerChannel(chan)
    wc.start()
    wc.serve()
    seg, layout = sl.attach_channel(chan)
    views = sl.ChannelViews(seg, layout)
    views.request_seq[0] += 1                         # a buggy client rings without writing a slot
    assert wc.has_request() and wc.next_request() is None
    assert int(views.done_seq[0]) == int(views.request_seq[0])
    del views
    seg.close()
    wc.close()


def test_wait_for_worker_names_the_fix_when_none_serves(chan):
    client = CpuPoolClient(chan)
    with pytest.raises(WorkerTimeout, match="ft worker cpu"):
        client.wait_for_worker(timeout_s=0.05)
    client.close()


def test_idle_waiter_spins_while_hot_then_sleeps_growing(monkeypatch):
    sleeps = []
    monkeypatch.setattr(ch.time, "sleep", sleeps.append)
    policy = IdlePolicy(hot_s=0.010, spin_s=50e-6, sleep_min_s=20e-6, sleep_max_s=100e-6)
    waiter = IdleWaiter(policy)
    ms = 1_000_000
    waiter.worked(0)
    for now in range(0, 10 * ms, ms // 10):            # 10 ms of hot turns: never sleeps
        waiter.pause(now)
    assert sleeps == []
    now = 11 * ms
    waiter.pause(now)                                  # cold: first a 50 us spin
    assert sleeps == []
    for _ in range(6):
        now += 60_000                                  # past the spin window each time
        waiter.pause(now)
        waiter.pause(now + 60_000)
    assert sleeps[:4] == [20e-6, 40e-6, 80e-6, 100e-6] and max(sleeps) == 100e-6
    waiter.worked(now)
    waiter.pause(now + 20 * ms)
    waiter.pause(now + 20 * ms + 60_000)
    assert sleeps[-1] == 20e-6                         # work resets the back-off


def test_a_replacement_claiming_the_channel_mid_wait_is_reported_as_dead(store, chan):
    first = ThreadWorker(chan, store)
    first.hold.set()
    first.start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    hidden, triples = batch(2, seed=5)
    client.submit(0, hidden, triples)
    first.stop()
    second = ThreadWorker(chan, store).start()        # done_seq jumps past the lost request
    with pytest.raises(WorkerDead, match="replaced"):
        client.wait(0, deadline_s=5)
    client.wait_for_worker(timeout_s=5)
    assert client.call(0, hidden, triples, deadline_s=5).shape == (2, H)
    second.stop()
    client.close()


def test_request_line_holds_the_split_fields_after_num_triples():
    """split_limit right after num_triples: a 64-bit store of num_triples at 16 (the stream doorbell's) leaves
    it 0, i.e. no split. Both fit the request's cache line."""
    fields = {name: sl.REQUEST_LINE.fields[name][1] for name in sl.REQUEST_LINE.names}
    assert fields == {"seq": 0, "layer": 8, "num_tokens": 12, "num_triples": 16, "split_limit": 20, "split_expert": 24}
    assert sl.REQUEST_LINE.itemsize <= sl.CACHE_LINE_BYTES and sl.SPLIT_CHANNEL_UNIT == 32
    assert sl.CHANNEL_VERSION >= 2


def test_a_channel_of_the_old_layout_is_refused(chan):
    """A worker (or client) built for another layout version refuses the channel at attach."""
    seg, _ = sl.attach_channel(chan)
    seg.u8[8:12].view("<u4")[0] = sl.CHANNEL_VERSION - 1         # the header's version word
    seg.close()
    with pytest.raises(shm_segment.ShmError, match=f"layout version {sl.CHANNEL_VERSION - 1}"):
        WorkerChannel(chan)


def test_split_fields_are_written_on_every_request(store, chan):
    """The worker end reads what the client wrote; a request without a split clears the slot's fields."""
    wc = WorkerChannel(chan)
    wc.start()
    wc.serve()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    hidden, triples = batch(2, seed=7)
    for layer, split in ((0, {"split_expert": 3, "split_limit": 64}), (2, {}),
                         (1, {"split_expert": 0, "split_limit": 32}), (3, {"split_expert": 2, "split_limit": 0})):
        seq = client.submit(layer, hidden, triples, **split)
        req = wc.next_request()
        assert req is not None and req.seq == seq and req.slot == layer % 2
        assert (req.split_expert, req.split_limit) == (split.get("split_expert", -1), split.get("split_limit", 0))
        wc.complete(req, sl.STATUS_OK)
        client.wait(layer, deadline_s=5)
    wc.close()
    client.close()


@pytest.mark.parametrize("split_expert, split_limit, named", [
    (1, 48, "split_limit 48"), (1, -32, "split_limit -32"), (1, 2 ** 31, "split_limit"), (-1, 32, "split_expert -1"),
    (2 ** 31, 0, "split_expert")])
def test_client_refuses_an_invalid_split(store, chan, split_expert, split_limit, named):
    worker = ThreadWorker(chan, store).start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    hidden, triples = batch(2, seed=8)
    with pytest.raises(ValueError, match=named):
        client.submit(0, hidden, triples, split_expert=split_expert, split_limit=split_limit)
    out = client.call(0, hidden, triples, deadline_s=5)          # nothing was rung: the slot is free
    torch.testing.assert_close(out, reference_moe_layer(store, 0, hidden, *triples), rtol=0.02, atol=0.02)
    worker.stop()
    client.close()


def test_a_split_the_worker_cannot_apply_is_a_bad_request(store, chan):
    """I = 32 here: no split limit fits below it, so the worker's kernel refuses one and the channel goes on."""
    worker = ThreadWorker(chan, store).start()
    client = CpuPoolClient(chan)
    client.wait_for_worker(timeout_s=5)
    hidden, triples = batch(2, seed=9)
    with pytest.raises(WorkerError, match="bad request"):
        client.call(0, hidden, triples, deadline_s=5, split_expert=1, split_limit=32)
    out = client.call(0, hidden, triples, deadline_s=5)          # the same slot, no split: computed whole
    torch.testing.assert_close(out, reference_moe_layer(store, 0, hidden, *triples), rtol=0.02, atol=0.02)
    worker.stop()
    client.close()
