"""The device hand-off kernels (kernels/handoff) through `DeviceDoorbell` against real `ft worker cpu`
processes: partial sums against the reference, the split by owner, padding, nothing rung, one sequence
with the host-driven path, and the faults (SIGKILL, SIGSTOP past the deadline, an error status), each of
which must leave dst = src, raise the failure flags and make later rings no-ops until reset.

Without a GPU the kernels run in the Triton interpreter on the host mapping; with one (-m gpu) the same
on CUDA tensors, plus a CUDA graph of two layers replayed with fresh sequence numbers.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from conftest import KERNEL_DEVICE
from ftexpert.cpu_expert_pool.api import IMPORT_ROOT, CpuWorkerProc
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.gpu_worker.backends.hybrid.device_doorbell import DeviceDoorbell
from ftexpert.kernels import handoff
from ftexpert.kernels.cuda_driver import CudaDriver, CudaDriverError, CudaDriverUnavailable, load_driver
from tests.cpu_expert_pool.cpu_pool_util import channel, procs, random_store, serve_channel  # noqa: F401 (fixtures)

H, I, E, L = 64, 32, 6, 2
T_MAX, MAX_TRIPLES = 8, 32
START_TIMEOUT_S = 60
WORKER_PROC_ARGS = ["--threads", "1", "--hot-ms", "5", "--no-pin"]


def stop_worker(proc: CpuWorkerProc) -> None:
    """SIGSTOP, and wait until the process is really stopped (the signal is asynchronous)."""
    proc.signal(signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    assert wait_until(stopped, 5), "the worker did not stop"


def wait_until(pred, timeout_s: float) -> bool:
    give_up = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.001)
    return True


@pytest.fixture(scope="module")
def store():
    s = random_store(f"ft-test-ddb-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=L, num_experts=E, hidden=H,
                     intermediate=I, config_hash="cfg-ddb")
    yield s
    s.close()
    s.unlink()


@pytest.fixture
def served(store, channel, procs):
    """(worker process, connected client, [things to close])."""
    proc, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    things = [client]
    yield proc, client, things
    for thing in reversed(things):
        thing.close()


def routes_case(T: int, K: int, seed: int, device: str, cpu_share: float = 0.5, pad_tokens: int = 0):
    """x [T, H] bf16, router ids [T, K] (the last pad_tokens rows are padding: -1), routes after a
    pretend ensure (-1 = CPU, else a slot id), weights [T, K], the CPU mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    if pad_tokens:
        ids[T - pad_tokens:] = -1
    cpu = (torch.rand(T, K, generator=g) < cpu_share) & (ids >= 0)
    routes = torch.where(cpu | (ids < 0), -1, 7).int()
    w = torch.rand(T, K, generator=g)
    return [t.to(device) for t in (x, ids, routes, w)] + [cpu]


def expected_partial(store, layer, x, ids, w, mask):
    rows = mask.flatten().nonzero().flatten()
    K = ids.shape[1]
    return reference_moe_layer(store, layer, x.cpu(), (rows // K).int(), ids.cpu().flatten()[rows].int(),
                               w.cpu().flatten()[rows])


def assert_close_to(store, got, want):
    torch.testing.assert_close(got.cpu(), want, rtol=0.02, atol=0.02 * float(want.abs().max()) + 1e-6)


def join_now(db, layer, src, dst):
    """db.join, then (on CUDA) wait for it: the failure word and the channel are read by the host next."""
    db.join(layer, src, dst)
    if dst.is_cuda:
        torch.cuda.synchronize()


def test_ring_and_join_match_the_reference(store, served):
    _, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, deadline_s=10)
    things.append(db)
    for i, (T, K, pad) in enumerate([(1, 4, 0), (3, 2, 0), (4, 3, 1), (2, 4, 0)]):
        layer = i % L
        x, ids, routes, w, cpu = routes_case(T, K, seed=i, device=KERNEL_DEVICE, pad_tokens=pad)
        src = torch.randn(T, H, device=KERNEL_DEVICE).to(torch.bfloat16)
        dst = torch.empty(T, H, device=KERNEL_DEVICE)
        db.ring(layer, x, ids, routes, w)
        join_now(db, layer, src, dst)
        want = src.float().cpu() + expected_partial(store, layer, x, ids, w, cpu)
        assert db.failure() == 0, db.failure_reason()
        assert_close_to(store, dst, want)
    c = db.counters()
    assert c["rings"] == c["answered"] == 4 and c["failed"] == 0 and c["triples"] > 0
    assert c["compute_ns"] > 0 and c["experts"] > 0


def test_only_the_members_experts_are_handed_off_and_an_empty_share_rings_nothing(store, served):
    _, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, member=1, deadline_s=10)
    things.append(db)
    owner = torch.tensor([[0, 1, 1, 0, 1, 0]] * L, dtype=torch.int32).flatten().to(KERNEL_DEVICE)   # [L*E]
    x, ids, routes, w, cpu = routes_case(3, 4, seed=3, device=KERNEL_DEVICE, cpu_share=0.7)
    mine = cpu & (owner.cpu().view(L, E)[1][ids.cpu().clamp(min=0).long()] == 1)
    assert mine.any() and (cpu & ~mine).any()
    src = torch.zeros(3, H, device=KERNEL_DEVICE)
    dst = torch.empty_like(src)
    db.ring(1, x, ids, routes, w, owner=owner, owner_offset=E)
    join_now(db, 1, src, dst)
    assert_close_to(store, dst, expected_partial(store, 1, x, ids, w, mine))
    # No route left to the CPU for this member: nothing rung, dst = src, the sequence unchanged.
    seq = client._words.request_seq[0]
    src = torch.randn(3, H, device=KERNEL_DEVICE)
    db.ring(0, x, ids, torch.full_like(routes, 3), w, owner=owner, owner_offset=0)
    join_now(db, 0, src, dst)
    assert torch.equal(dst, src) and client._words.request_seq[0] == seq
    # In place (src is dst) with nothing rung leaves it alone.
    db.ring(1, x, ids, torch.full_like(routes, 3), w)
    join_now(db, 1, dst, dst)
    assert torch.equal(dst, src) and db.failure() == 0


def test_device_and_host_driven_calls_share_one_sequence(store, served):
    _, client, things = served
    x, ids, routes, w, cpu = routes_case(2, 3, seed=5, device=KERNEL_DEVICE, cpu_share=1.0)
    rows = cpu.flatten().nonzero().flatten()
    triples = ((rows // 3).int(), ids.cpu().flatten()[rows].int(), w.cpu().flatten()[rows])
    host = client.call(0, x.cpu(), triples, deadline_s=10).clone()
    db = DeviceDoorbell(client, KERNEL_DEVICE, deadline_s=10)
    things.append(db)
    dst = torch.empty(2, H, device=KERNEL_DEVICE)
    db.ring(0, x, ids, routes, w)
    join_now(db, 0, torch.zeros(2, H, device=KERNEL_DEVICE), dst)
    assert client._words.request_seq[0] == client._words.done_seq[0] == 2
    assert torch.equal(dst.cpu(), host)
    again = client.call(0, x.cpu(), triples, deadline_s=10)           # seq 3, after the device's 2
    assert torch.equal(again, host) and client._words.done_seq[0] == 3
    db.sync_sequence()                          # the device's copy of the sequence takes the host's call
    db.ring(0, x, ids, routes, w)
    join_now(db, 0, torch.zeros(2, H, device=KERNEL_DEVICE), dst)
    assert client._words.done_seq[0] == 4 and db.failure() == 0 and torch.equal(dst.cpu(), host)


def ring_a_stopped_worker(served, seed: int, T: int = 2, **doorbell_kw):
    """A doorbell on the served channel and layer 0's call (every route to the CPU) rung to its stopped
    worker: (doorbell, (x, ids, routes, w, cpu), src [T, H], dst [T, H])."""
    proc, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, **doorbell_kw)
    things.append(db)
    case = routes_case(T, 4, seed=seed, device=KERNEL_DEVICE, cpu_share=1.0)
    src = torch.randn(T, H, device=KERNEL_DEVICE)
    stop_worker(proc)
    db.ring(0, *case[:4])
    return db, case, src, torch.empty_like(src)


def test_the_join_records_how_long_it_waited_for_the_worker(store, served):
    """ST_WAIT_NS: a join that had to wait for a stopped worker adds a positive wait; one whose answer was
    already in the channel adds less (the interpreter's clock counts spins: none, so nothing)."""
    proc, client, _ = served
    db, (x, ids, routes, w, cpu), src, dst = ring_a_stopped_worker(served, seed=13, deadline_s=30)
    resume = threading.Timer(0.3, proc.signal, (signal.SIGCONT,))
    resume.start()
    join_now(db, 0, src, dst)                                       # spins until the worker is back
    resume.join()
    waited = db.counters()["wait_ns"]
    assert db.failure() == 0 and waited > 0
    assert_close_to(store, dst, src.cpu() + expected_partial(store, 0, x, ids, w, cpu))
    if dst.is_cuda:                                                # the global timer: real nanoseconds
        assert waited >= 0.2e9
    db.ring(1, x, ids, routes, w)
    if dst.is_cuda:
        torch.cuda.synchronize()
    assert wait_until(lambda: client._words.done_seq[0] == client._words.request_seq[0], 10)
    join_now(db, 1, src, dst)                                       # the answer is there at the first poll
    ready = db.counters()["wait_ns"] - waited
    assert db.failure() == 0 and db.counters()["answered"] == 2
    assert 0 <= ready < waited
    if not dst.is_cuda:
        assert ready == 0
    db.ring(0, x, ids, torch.full_like(routes, 3), w)             # nothing rung: no wait counted
    join_now(db, 0, src, dst)
    assert db.counters()["wait_ns"] == waited + ready


def test_a_killed_worker_aborts_the_wait_and_later_rings_do_nothing_until_reset(store, channel, served, procs):
    proc, client, _ = served
    aborts = []
    db, (x, ids, routes, w, cpu), src, dst = ring_a_stopped_worker(
        served, seed=7, deadline_s=30, poll_s=1e-3, on_abort=lambda *a: aborts.append(a))

    def kill_soon():
        time.sleep(0.2)
        proc.signal(signal.SIGKILL)
        db.kick()
    killer = threading.Thread(target=kill_soon)
    killer.start()
    t0 = time.monotonic()
    join_now(db, 0, src, dst)                                       # spins until the watchdog aborts it
    waited = time.monotonic() - t0
    killer.join()
    assert waited < 5, f"the join spun {waited:.1f} s after the worker died"
    assert db.failure() == handoff.FAIL_ABORTED and "dead" in db.failure_reason()
    assert int(db.fail.item()) == 1 and torch.equal(dst, src)
    assert aborts and aborts[0][0] == "dead"
    # The step's later rings are no-ops while the flag is up.
    seq = client._words.request_seq[0]
    db.ring(1, x, ids, routes, w)
    join_now(db, 1, src, dst)
    assert client._words.request_seq[0] == seq and torch.equal(dst, src)
    # A restarted worker, reset flags: valid again, with a fresh sequence number.
    proc.wait(timeout_s=5)
    procs(store_name=store.name, channel_name=channel)
    db.reconnect(timeout_s=START_TIMEOUT_S)
    assert db.failure() == 0 and int(db.fail.item()) == 0
    db.ring(0, x, ids, routes, w)
    join_now(db, 0, src, dst)
    assert db.failure() == 0 and client._words.done_seq[0] > seq
    assert_close_to(store, dst, src.cpu() + expected_partial(store, 0, x, ids, w, cpu))


def test_a_stopped_worker_is_given_up_on_after_the_deadline(store, served):
    proc = served[0]
    late = []
    db, _, src, dst = ring_a_stopped_worker(served, seed=8, T=1, deadline_s=0.3, poll_s=1e-3,
                                            on_abort=lambda *a: late.append(a))
    db.kick()
    t0 = time.monotonic()
    join_now(db, 0, src, dst)
    assert time.monotonic() - t0 < 5
    assert db.failure() in (handoff.FAIL_ABORTED, handoff.FAIL_TIMEOUT) and torch.equal(dst, src)
    assert wait_until(lambda: bool(late), 2) and late[0][0] == "timeout"
    proc.signal(signal.SIGCONT)


def test_an_error_status_is_a_failure_and_not_joined(store, served):
    _, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, deadline_s=10)
    things.append(db)
    x, ids, routes, w, _ = routes_case(1, 2, seed=9, device=KERNEL_DEVICE, cpu_share=1.0)
    ids = torch.full_like(ids, E + 3)                      # out of the store's range: the worker refuses it
    src = torch.randn(1, H, device=KERNEL_DEVICE)
    dst = torch.empty_like(src)
    db.ring(0, x, ids, routes, w)
    join_now(db, 0, src, dst)
    assert db.failure() == handoff.FAIL_STATUS and torch.equal(dst, src)
    assert db.counters()["failed"] == 1


def test_a_ring_without_a_split_clears_the_split_an_earlier_ring_wrote(store, served):
    """Every ring writes the line's split: one that cannot apply here (c = I = 32: the worker refuses it as a bad
    request) is followed on the same slot by a ring without one, which the worker must compute whole."""
    _, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, deadline_s=10)
    things.append(db)
    x, ids, routes, w, cpu = routes_case(1, 4, seed=11, device=KERNEL_DEVICE, cpu_share=1.0)
    src = torch.zeros(1, H, device=KERNEL_DEVICE)
    split = torch.tensor([int(ids[0, 0]), 32], dtype=torch.int32, device=KERNEL_DEVICE)
    db.ring(0, x, ids, routes, w, split=split, split_slot=99)
    join_now(db, 0, src, torch.empty(1, H, device=KERNEL_DEVICE))
    assert db.failure() == handoff.FAIL_STATUS                   # the worker saw the split in the line
    db.reset()
    dst = torch.empty(1, H, device=KERNEL_DEVICE)
    db.ring(0, x, ids, routes, w)                                 # layer 0 again: the same slot
    join_now(db, 0, src, dst)
    assert db.failure() == 0, db.failure_reason()
    assert_close_to(store, dst, expected_partial(store, 0, x, ids, w, cpu))


def test_arguments_are_checked(store, served):
    _, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE)
    things.append(db)
    x, ids, routes, w, _ = routes_case(2, 2, seed=1, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="do not fit channel"):
        db.ring(0, torch.zeros(T_MAX + 1, H, device=KERNEL_DEVICE), ids, routes, w)
    with pytest.raises(ValueError, match=r"must all be \[T=2, K\]"):
        db.ring(0, x, ids, routes[:1], w)
    with pytest.raises(ValueError, match="must be contiguous and alike"):
        db.join(0, torch.zeros(2, H, device=KERNEL_DEVICE), torch.zeros(3, H, device=KERNEL_DEVICE))


@pytest.mark.gpu
def test_gpu_a_captured_graph_rings_fresh_sequence_numbers(store, served):
    _, client, things = served
    db = DeviceDoorbell(client, "cuda", deadline_s=10)
    things.append(db)
    x, ids, routes, w, cpu = routes_case(2, 4, seed=11, device="cuda", cpu_share=0.6)
    src = torch.randn(2, H, device="cuda")
    dst = [torch.empty(2, H, device="cuda") for _ in range(L)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                        # warm-up (compiles) outside the capture
        for layer in range(L):
            db.ring(layer, x, ids, routes, w)
            db.join(layer, src, dst[layer])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert db.failure() == 0, "eager warm-up: " + db.failure_reason()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(L):
            db.ring(layer, x, ids, routes, w)
            db.join(layer, src, dst[layer])
    for replay in range(3):
        before = client._words.done_seq[0]
        x.copy_(torch.randn(2, H, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert db.failure() == 0, db.failure_reason()
        assert client._words.done_seq[0] == before + L
        for layer in range(L):
            assert_close_to(store, dst[layer], src.cpu() + expected_partial(store, layer, x, ids, w, cpu))


def test_a_claimed_channel_is_a_replaced_worker_not_an_error_status(store, served):
    """done_seq passing the request without its response is what a restarted worker's claim looks like."""
    proc, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, deadline_s=30, watchdog=False)
    things.append(db)
    x, ids, routes, w, _ = routes_case(1, 2, seed=12, device=KERNEL_DEVICE, cpu_share=1.0)
    src = torch.randn(1, H, device=KERNEL_DEVICE)
    dst = torch.empty_like(src)
    stop_worker(proc)
    db.ring(0, x, ids, routes, w)
    if dst.is_cuda:
        torch.cuda.synchronize()
    client._words.done_seq[0] = client._words.request_seq[0]        # a replacement's claim
    join_now(db, 0, src, dst)
    assert db.failure() == handoff.FAIL_REPLACED and "replaced" in db.failure_reason()
    assert torch.equal(dst, src)
    proc.signal(signal.SIGKILL)


def test_the_deadline_lives_in_the_state_and_a_stale_abort_is_cleared_on_arm(store, served):
    _, client, things = served
    db = DeviceDoorbell(client, KERNEL_DEVICE, deadline_s=2.5)
    things.append(db)
    assert int(db.state[handoff.ST_DEADLINE_NS]) == 2_500_000_000
    db.deadline_s = 0.25                                  # a captured graph reads the word, not a constant
    assert int(db.state[handoff.ST_DEADLINE_NS]) == 250_000_000
    db._abort.value = 2                                   # raised during a host-driven call since answered
    db.arm()
    assert db._abort.value == 0 and db.in_flight >= 1     # armed: the watchdog keeps looking
    db.disarm()
    assert db.in_flight == 0
    db._abort.value, db._host_fail.value = 2, handoff.FAIL_ABORTED    # a failure not yet handled: kept
    db.arm()
    assert db._abort.value == 2
    db.reset()
    assert db._abort.value == 0 and db.failure() == 0


def test_the_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real compiler on the hand-off kernels and the plan copy (the interpreter accepts what
    PTX may not): the inline PTX assembles, the ring fences, the join spins with acquire loads, and the
    mapped-memory reads are 16-byte vectors."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ftexpert.kernels.handoff.compile_check"], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line[:22].strip(): line[22:] for line in proc.stdout.splitlines() if line.strip()}
    assert "ld.global.v4 2" in rows["plan copy aligned"] and "plan copy prefetch" not in rows
    assert "fence.acq_rel.sys 2" in rows["ring owner bf16"]
    join = dict(zip(rows["join bf16 -> fp32"].split()[::2], map(int, rows["join bf16 -> fp32"].split()[1::2])))
    # the join polls with acquire loads, then reads the partial sums as 16-byte vectors: `.cv` ones where the
    # Triton version emits the modifier (3.9 in CI), plain ones where it does not (3.6 on the H200 machine)
    # (besides the two plain vector loads of src): 2 x .cv where emitted, else 2 more plain ones
    assert join["ld.acquire.sys"] >= 1 and (join["ld.global.cv.v4"] == 2 or join["ld.global.v4"] >= 4)


def _count_reference(ids: torch.Tensor, fetched: int, missing: int, offload: bool) -> list[int]:
    flat = ids.flatten().tolist()
    distinct = len({e for e in flat if e >= 0})
    return [fetched, missing, 1, int(offload), len(flat), distinct - missing]


@pytest.mark.parametrize("n", [1, 2, 7, 16, 17, 32, 40, 256])
def test_count_call_matches_a_plain_count(n):
    """ftexpert.kernels.handoff.count_call (the device path's per-layer counters) against a Python count, call after
    call on the same counters: plan length, distinct misses, calls, offload calls, pairs, distinct hits."""
    gen = torch.Generator().manual_seed(n)
    counts = torch.zeros(handoff.COUNTERS, dtype=torch.int64, device=KERNEL_DEVICE)
    want = [0] * handoff.COUNTERS
    for call in range(4):
        ids = torch.randint(0, max(2, n // 2), (n,), generator=gen, dtype=torch.int32)   # duplicates on purpose
        if call == 3 and n > 1:
            ids = torch.stack([ids, ids], 1)[:, 0]                     # not contiguous: counted all the same
            assert not ids.is_contiguous()
        distinct = len(set(ids.tolist()))
        missing = int(torch.randint(0, distinct + 1, (1,), generator=gen))
        fetched = int(torch.randint(0, missing + 1, (1,), generator=gen))
        offload = call % 2 == 1
        handoff.count_call(counts, ids.to(KERNEL_DEVICE),
                           torch.tensor([fetched], dtype=torch.int32, device=KERNEL_DEVICE),
                           torch.tensor([missing], dtype=torch.int32, device=KERNEL_DEVICE), offload=offload)
        want = [a + b for a, b in zip(want, _count_reference(ids, fetched, missing, offload))]
        assert counts.tolist() == want, f"call {call}"


def test_count_call_refuses_what_it_cannot_count():
    counts = torch.zeros(handoff.COUNTERS, dtype=torch.int64, device=KERNEL_DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="1..256 entries"):
        handoff.count_call(counts, torch.zeros(handoff.COUNT_MAX_PAIRS + 1, dtype=torch.int32,
                                               device=KERNEL_DEVICE), one, one, offload=False)
    with pytest.raises(ValueError, match="int64"):
        handoff.count_call(counts.int(), one, one, one, offload=False)


# ---------------------------------------------------------------------------------------------
# The CUDA driver binding (kernels/cuda_driver.py): loaded lazily, clear errors, against a stand-in library
# ---------------------------------------------------------------------------------------------
def test_importing_loads_no_cuda_driver():
    # torch's CUDA build may map libcuda itself at import (it does on the H200 machine): what must
    # not happen is that importing these modules adds it
    code = ("import torch; before = 'libcuda.so' in open('/proc/self/maps').read(); "
            "import ftexpert.kernels.cuda_driver as m, ftexpert.gpu_worker.backends.hybrid.device_doorbell; assert m._DRIVER is None; "
            "after = 'libcuda.so' in open('/proc/self/maps').read(); "
            "assert before or not after, 'libcuda loaded by importing the driver binding'")
    env = dict(os.environ, PYTHONPATH=str(IMPORT_ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=IMPORT_ROOT, env=env, timeout=120)


def test_a_missing_driver_library_is_a_clear_error():
    with pytest.raises(CudaDriverUnavailable, match=r"libcuda-missing\.so\.1.*no NVIDIA driver"):
        load_driver(names=("libcuda-missing.so.1",))


class FakeLib:
    """Python functions standing in for libcuda's exports (ctypes only sets argtypes/restype on them)."""

    def __init__(self, *, pointer_result=0, driver_version=12040, attributes=None):
        attributes = attributes if attributes is not None else {}

        def out(arg, value):
            arg._obj.value = value                                 # ctypes.byref(x)._obj is x
            return 0

        def device_pointer(p, host, flags):
            return pointer_result or out(p, host.value + 0x1000)

        def error_name(code, p):
            if code != 1:
                return 1
            p._obj.value = b"CUDA_ERROR_INVALID_VALUE"
            return 0

        self.cuInit = lambda flags: 0
        self.cuDriverGetVersion = lambda p: out(p, driver_version)
        self.cuDeviceGet = lambda p, ordinal: out(p, ordinal)
        self.cuDeviceGetAttribute = lambda p, attr, dev: out(p, attributes.get(attr, 1))
        self.cuMemHostGetDevicePointer_v2 = device_pointer
        self.cuGetErrorName = error_name


def test_the_driver_binding_against_a_stand_in_library():
    drv = CudaDriver(FakeLib())
    assert drv.driver_version == 12040
    assert drv.device_pointer(0x10000) == 0x11000
    assert drv.capabilities(0) == {"driver_version": 12040, "unified_addressing": 1,
                                   "host_pointer_for_registered_mem": 1}


def test_failed_calls_name_the_call_and_the_cuda_error():
    drv = CudaDriver(FakeLib(pointer_result=1))
    with pytest.raises(CudaDriverError, match=r"cuMemHostGetDevicePointer\(0x40\) failed: CUDA_ERROR_INVALID_VALUE "
                                              r"\(1\); .*cudaHostRegisterMapped") as exc:
        drv.device_pointer(0x40)
    assert (exc.value.code, exc.value.name) == (1, "CUDA_ERROR_INVALID_VALUE")
    assert drv.error_name(999) == "CUDA_ERROR_UNKNOWN"                 # cuGetErrorName failed: the table
    lib = FakeLib()
    del lib.cuMemHostGetDevicePointer_v2
    with pytest.raises(CudaDriverUnavailable, match="lacks a CUDA driver entry point"):
        CudaDriver(lib)
