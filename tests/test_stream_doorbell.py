"""The GPU-stream side of the doorbell (gpu_worker/hybrid/stream_doorbell.py).

Without a GPU: lazy loading and the errors of a machine without libcuda, symbol resolution and
CUresult/attribute errors against stand-in libraries, and the whole call / watchdog / validity logic with
``backend="host"`` (a host thread plays the stream) against thread-served channels and real `ft worker cpu`
processes (SIGKILL, SIGSTOP). With a GPU (``-m gpu``): the same round trip and the SIGKILL release on a
real CUDA stream with cuStreamWriteValue64 / cuStreamWaitValue64, and the refusal to be graph-captured.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from proto.cpu_channel import CpuPoolClient, WorkerDead, WorkerTimeout
from cpu_expert_pool.api import REPO_ROOT, CpuWorkerProc
from cpu_expert_pool.reference import reference_moe_layer
from gpu_worker.hybrid import stream_doorbell as sd
from gpu_worker.hybrid.stream_doorbell import (CudaDriver, CudaDriverError, StreamDoorbell, StreamMemOpsUnavailable,
                                               load_driver, resolve_stream_memops)
from tests.cpu_pool_util import channel, procs, random_store, serve_channel  # noqa: F401 (fixtures)
from tests.test_cpu_pool_channel import ThreadWorker

H, I, E, L = 64, 32, 4, 2
T_MAX, MAX_TRIPLES = 8, 16
START_TIMEOUT_S = 60
DEATH_DEADLINE_S = 2.0          # a dead worker's stream must be released within this
WORKER_ARGS = ["--threads", "1", "--hot-ms", "5", "--no-pin"]
WORKER_PROC_ARGS = WORKER_ARGS       # every worker the `procs` fixture starts gets them


@pytest.fixture(scope="module")
def store():
    s = random_store(f"ft-test-sdb-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=L, num_experts=E, hidden=H,
                     intermediate=I, config_hash="cfg-sdb")
    yield s
    s.close()
    s.unlink()


@pytest.fixture
def closing():
    """Close doorbells, then clients, at the end of a test (also when it fails)."""
    things: list = []
    yield things.append
    for thing in reversed(things):
        thing.close()


def batch(num_tokens: int, num_triples_per_token: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    k = num_triples_per_token
    token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(k)
    expert_id = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(num_tokens)]).flatten().int()
    weight = torch.rand(k * num_tokens, generator=g)
    return hidden.to(device), tuple(t.to(device) for t in (token_idx, expert_id, weight))


def assert_matches_reference(store, layer, hidden, triples, out):
    ref = reference_moe_layer(store, layer, hidden.cpu(), *(t.cpu() for t in triples))
    torch.testing.assert_close(out.cpu(), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()) + 1e-6)


def word(address: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(address)


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


# ---------------------------------------------------------------------------------------------
# Loading the driver: lazily, and clear errors without one
# ---------------------------------------------------------------------------------------------
def test_importing_loads_no_cuda_driver():
    # torch's CUDA build may map libcuda itself at import (it does on the H200 machine): what must
    # not happen is that importing this module adds it
    code = ("import torch; before = 'libcuda.so' in open('/proc/self/maps').read(); "
            "import gpu_worker.hybrid.stream_doorbell as m, gpu_worker.hybrid as h; assert m._DRIVER is None; "
            "assert h.StreamDoorbell is m.StreamDoorbell; "
            "after = 'libcuda.so' in open('/proc/self/maps').read(); "
            "assert before or not after, 'libcuda loaded by importing stream_doorbell'")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=env, timeout=120)


def test_a_missing_driver_library_is_a_clear_error():
    with pytest.raises(StreamMemOpsUnavailable, match=r"libcuda-missing\.so\.1.*host-driven"):
        load_driver(names=("libcuda-missing.so.1",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_the_cuda_backend_without_a_gpu_is_a_clear_error(store, channel, closing):
    worker = ThreadWorker(channel, store).start()
    closing(type("Stop", (), {"close": lambda self: worker.stop()})())
    client = CpuPoolClient(channel)
    closing(client)
    client.wait_for_worker(timeout_s=5)
    with pytest.raises(StreamMemOpsUnavailable, match="needs a CUDA device"):
        StreamDoorbell(client, "cuda")
    with pytest.raises(StreamMemOpsUnavailable, match="needs a CUDA device"):
        StreamDoorbell(client, "cpu", backend="cuda")


def test_a_doorbell_needs_a_connected_client(channel, closing):
    client = CpuPoolClient(channel)
    closing(client)
    with pytest.raises(WorkerDead, match="wait_for_worker"):
        StreamDoorbell(client, "cpu")


# ---------------------------------------------------------------------------------------------
# Symbol resolution and driver errors, against stand-in libraries
# ---------------------------------------------------------------------------------------------
class FakeLib:
    """Python functions standing in for libcuda's exports (ctypes only sets argtypes/restype on them)."""

    def __init__(self, *, exports=("v2",), attributes=None, memop_result=0, driver_version=12040):
        self.calls: list[tuple] = []
        self.attributes = attributes if attributes is not None else {}

        def memop(kind):
            def fn(stream, addr, value, flags):
                self.calls.append((kind, stream, addr, value, flags))
                return memop_result
            return fn

        if "v2" in exports:
            self.cuStreamWriteValue64_v2, self.cuStreamWaitValue64_v2 = memop("write_v2"), memop("wait_v2")
        if "v1" in exports:
            self.cuStreamWriteValue64, self.cuStreamWaitValue64 = memop("write_v1"), memop("wait_v1")
        if "proc" in exports:
            self._callbacks = {name: sd._MEMOP_FUNCTYPE(memop(f"{name}@proc"))
                               for name in ("cuStreamWriteValue64", "cuStreamWaitValue64")}

            def get_proc(symbol, pfn, version, flags):
                self.calls.append(("cuGetProcAddress", symbol, version, flags))
                cb = self._callbacks.get(symbol.decode())
                if cb is None:
                    return 500                                     # CUDA_ERROR_NOT_FOUND
                pfn.contents.value = ctypes.cast(cb, ctypes.c_void_p).value
                return 0
            self.cuGetProcAddress = get_proc

        def out(arg, value):
            arg._obj.value = value                                 # ctypes.byref(x)._obj is x
            return 0

        self.cuInit = lambda flags: 0
        self.cuDriverGetVersion = lambda p: out(p, driver_version)
        self.cuDeviceGet = lambda p, ordinal: out(p, ordinal)
        self.cuDeviceGetAttribute = lambda p, attr, dev: out(p, self.attributes.get(attr, 1))
        self.cuCtxGetCurrent = lambda p: out(p, 0x1234)
        self.cuMemHostGetDevicePointer_v2 = lambda p, host, flags: out(p, host.value + 0x1000)
        self.cuStreamIsCapturing = lambda stream, p: out(p, 0)

        def error_name(code, p):
            if code != 801:
                return 1
            p._obj.value = b"CUDA_ERROR_NOT_SUPPORTED"
            return 0
        self.cuGetErrorName = error_name


def test_the_versioned_v2_memops_are_preferred():
    resolved = resolve_stream_memops(FakeLib(exports=("v2", "v1", "proc")))
    assert (resolved.api, resolved.how) == (2, "dlsym cuStreamWriteValue64_v2")


def test_cu_get_proc_address_is_used_when_the_v2_symbols_are_not_exported():
    lib = FakeLib(exports=("proc", "v1"))
    resolved = resolve_stream_memops(lib, driver_version=12040)
    assert resolved.api == 2 and resolved.how.startswith("cuGetProcAddress")
    assert resolved.write64(0, 0x40, 7, 0) == 0 and resolved.wait64(0, 0x80, 9, 0) == 0
    assert lib.calls[-2:] == [("cuStreamWriteValue64@proc", None, 0x40, 7, 0),
                              ("cuStreamWaitValue64@proc", None, 0x80, 9, 0)]
    assert ("cuGetProcAddress", b"cuStreamWriteValue64", sd.PROC_ADDRESS_CUDA_VERSION, 0) in lib.calls
    assert resolve_stream_memops(FakeLib(exports=("proc",)), driver_version=11080).api == 1


def test_the_unversioned_v1_memops_are_the_last_resort():
    resolved = resolve_stream_memops(FakeLib(exports=("v1",)))
    assert (resolved.api, resolved.how) == (1, "dlsym cuStreamWriteValue64")


def test_a_driver_without_any_memops_is_a_clear_error():
    with pytest.raises(StreamMemOpsUnavailable, match="too old for the GPU-stream hand-off"):
        resolve_stream_memops(FakeLib(exports=()))


def test_devices_without_64_bit_memops_are_refused_with_the_attribute_named():
    drv = CudaDriver(FakeLib(attributes={sd.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: 0}))
    assert drv.driver_version == 12040 and drv.memops.api == 2
    with pytest.raises(CudaDriverError, match="CAN_USE_64_BIT_STREAM_MEM_OPS.*CUDA_ERROR_NOT_SUPPORTED \\(801\\)") \
            as exc:
        drv.require_stream_memops(0)
    assert exc.value.code == sd.CUDA_ERROR_NOT_SUPPORTED
    CudaDriver(FakeLib()).require_stream_memops(0)                     # 122 = 1: fine
    # v1 entry points are gated by the v1 attributes (92, 93), which need NVreg_EnableStreamMemOPs=1
    v1 = CudaDriver(FakeLib(exports=("v1",), attributes={sd.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: 0}))
    with pytest.raises(CudaDriverError, match="STREAM_MEM_OPS_V1.*NVreg_EnableStreamMemOPs=1"):
        v1.require_stream_memops(0)


def test_failed_calls_name_the_call_and_the_cuda_error():
    drv = CudaDriver(FakeLib(memop_result=801))
    with pytest.raises(CudaDriverError, match=r"cuStreamWaitValue64_v2\(0x40, 3\) failed: CUDA_ERROR_NOT_SUPPORTED "
                                              r"\(801\); .*host-driven") as exc:
        drv.wait_value64(0, 0x40, 3)
    assert (exc.value.call, exc.value.code, exc.value.name) == ("cuStreamWaitValue64_v2(0x40, 3)", 801,
                                                               "CUDA_ERROR_NOT_SUPPORTED")
    with pytest.raises(CudaDriverError, match=r"cuStreamWriteValue64_v2.*CUDA_ERROR_NOT_SUPPORTED"):
        drv.write_value64(0, 0x40, 3)
    assert drv.error_name(999) == "CUDA_ERROR_UNKNOWN"                 # cuGetErrorName failed: the table
    assert drv.device_pointer(0x10000) == 0x11000 and drv.has_current_context()
    caps = drv.capabilities(0)
    assert caps["memops_api"] == 2 and caps["64_bit_stream_mem_ops"] == 1


def test_ok_memops_are_forwarded_with_the_default_flags():
    lib = FakeLib()
    drv = CudaDriver(lib)
    drv.write_value64(5, 0x100, 7)
    drv.wait_value64(5, 0x108, 7)
    assert lib.calls == [("write_v2", 5, 0x100, 7, sd.CU_STREAM_WRITE_VALUE_DEFAULT),
                         ("wait_v2", 5, 0x108, 7, sd.CU_STREAM_WAIT_VALUE_GEQ)]


# ---------------------------------------------------------------------------------------------
# The call, validity and the watchdog with the host backend (a thread plays the stream)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def threaded(store, channel, closing):
    """(worker thread, connected client) on a fresh channel."""
    worker = ThreadWorker(channel, store).start()
    client = CpuPoolClient(channel)
    closing(client)
    closing(type("Stop", (), {"close": lambda self: worker.stop()})())
    client.wait_for_worker(timeout_s=5)
    return worker, client


def test_host_backend_round_trips_match_the_reference(store, threaded, closing):
    _, client = threaded
    db = StreamDoorbell(client, "cpu")
    closing(db)
    calls = []
    # Run ahead: every call enqueued before any is done; token and triple counts change per slot
    # (the request line words are rewritten only when they change).
    for i, (t, k) in enumerate([(3, 2), (1, 1), (3, 2), (5, 2), (2, 0), (2, 0), (8, 2)]):
        hidden, triples = batch(t, k, seed=i)
        calls.append((db.enqueue(i % L, hidden, triples if k else None), hidden, triples))
    for call, hidden, triples in calls:
        assert call.wait(timeout_s=10)
        assert call.valid() and call.status() == "ok"
        assert_matches_reference(store, call.layer, hidden, triples, call.out)
    assert [c.seq for c, _, _ in calls] == list(range(1, len(calls) + 1))
    # The stream wrote the doorbell words themselves, as a GPU stream would.
    doorbell = client.doorbell_addresses()
    assert word(doorbell["request_seq"]).value == word(doorbell["done_seq"]).value == len(calls)
    assert db.in_flight == 0 and db.progress() == len(calls)


def test_host_driven_calls_and_stream_calls_share_one_sequence(store, threaded, closing):
    _, client = threaded
    hidden, triples = batch(2, 2, seed=1)
    client.call(0, hidden, triples, deadline_s=5)
    client.call(1, hidden, triples, deadline_s=5)
    db = StreamDoorbell(client, "cpu")
    closing(db)
    call = db.enqueue(0, hidden, triples)
    assert call.seq == 3 and call.wait(5) and call.valid()
    assert_matches_reference(store, 0, hidden, triples, call.out)
    assert db.drain(5)
    assert torch.equal(client.call(0, hidden, triples, deadline_s=5), call.out)     # seq 4, after the drain


def test_a_worker_error_status_makes_the_call_invalid(store, threaded, closing):
    _, client = threaded
    db = StreamDoorbell(client, "cpu")
    closing(db)
    hidden, (token_idx, expert_id, weight) = batch(2, 2, seed=3)
    bad = db.enqueue(0, hidden, (token_idx, torch.full_like(expert_id, E + 5), weight))    # expert out of range
    good = db.enqueue(1, hidden, (token_idx, expert_id, weight))
    assert bad.wait(5) and good.wait(5)
    assert not bad.valid() and bad.status() == "bad request"
    assert good.valid()
    unchecked = StreamDoorbell(client, "cpu", check_status=False)
    closing(unchecked)
    call = unchecked.enqueue(0, hidden, (token_idx, expert_id, weight))
    assert call.wait(5) and call.status() == "unchecked" and call.valid()


def test_validity_must_be_read_within_the_status_ring(threaded, closing):
    _, client = threaded
    db = StreamDoorbell(client, "cpu", ring_size=4)
    closing(db)
    calls = [db.enqueue(i % 2, torch.zeros(1, H, dtype=torch.bfloat16)) for i in range(6)]
    assert calls[-1].wait(5)
    assert calls[-1].valid()
    with pytest.raises(RuntimeError, match="overwritten by request 5"):
        calls[0].valid()


def test_enqueue_checks_its_arguments(threaded, closing):
    _, client = threaded
    db = StreamDoorbell(client, "cpu")
    closing(db)
    x = torch.zeros(2, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        db.enqueue(0, torch.zeros(2, H + 1))
    with pytest.raises(ValueError, match="does not fit"):
        db.enqueue(0, torch.zeros(T_MAX + 1, H))
    with pytest.raises(ValueError, match="triples"):
        db.enqueue(0, x, (torch.zeros(MAX_TRIPLES + 1, dtype=torch.int32),) * 2 + (torch.zeros(MAX_TRIPLES + 1),))
    with pytest.raises(ValueError, match="out must be"):
        db.enqueue(0, x, out=torch.zeros(3, H))
    with pytest.raises(ValueError, match="layer"):
        db.enqueue(-1, x)
    assert db.in_flight == 0 and db.progress() == db._last_seq                   # nothing was enqueued
    call = db.enqueue(0, x.float(), out=torch.full((2, H), 7.0))                 # fp32 hidden: cast to bf16
    assert call.wait(5) and call.valid() and torch.equal(call.out, torch.zeros(2, H))


def test_the_watchdog_times_out_a_hung_worker_and_keeps_the_release_asserted(threaded, closing):
    """Deterministic: no watchdog thread, the checks are called by hand with a chosen clock."""
    worker, client = threaded
    aborts = []
    db = StreamDoorbell(client, "cpu", watchdog=False, deadline_s=0.5, on_abort=lambda *a: aborts.append(a))
    closing(db)
    worker.hold.set()                                   # takes requests, never answers
    call = db.enqueue(0, torch.ones(1, H, dtype=torch.bfloat16))
    assert wait_until(lambda: client.doorbell_addresses() and db._request_seq.value == call.seq, 5)
    state: dict = {}
    now = time.monotonic()
    db.watchdog_check(now, state)
    assert db.failed is None and not call.done()        # rung, unanswered, within the deadline
    db.watchdog_check(now + 0.6, state)
    assert db.failed == "timeout" and aborts == [("timeout", call.seq, call.seq)]
    assert call.wait(5) and not call.valid() and call.status() == "aborted"
    with pytest.raises(WorkerTimeout, match="gave up"):
        db.enqueue(1, torch.ones(1, H, dtype=torch.bfloat16))
    # Keeps done_seq released while the stream has not passed an aborted call (a late worker may lower it).
    gate = threading.Event()
    worker.hold.clear()
    assert db.reconnect(timeout_s=5) == os.getpid() and db.failed is None
    worker.hold.set()
    db._host_stream.submit(gate.wait)                   # the stream stops before the next call
    late = db.enqueue(1, torch.ones(1, H, dtype=torch.bfloat16))
    first, last = db.abort("test")
    assert (first, last) == (late.seq, late.seq) and db._done_seq.value == late.seq
    db._done_seq.value = late.seq - 1                   # a late worker answers an older request
    db.watchdog_check(time.monotonic(), {})
    assert db._done_seq.value == late.seq
    gate.set()
    assert late.wait(5) and not late.valid()


@pytest.mark.parametrize("watchdog", [True, False])
def test_closing_a_doorbell_whose_worker_hangs_does_not_hang(threaded, watchdog):
    worker, client = threaded
    db = StreamDoorbell(client, "cpu", watchdog=watchdog, deadline_s=10)
    worker.hold.set()
    call = db.enqueue(0, torch.ones(1, H, dtype=torch.bfloat16))
    t0 = time.monotonic()
    db.close(timeout_s=0.2)
    assert time.monotonic() - t0 < 3 and call.done() and not call.valid()


# -- real worker processes ----------------------------------------------------------------------
def test_host_backend_against_a_worker_process(store, channel, procs, closing):
    _, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    closing(client)
    db = StreamDoorbell(client, "cpu", deadline_s=5)
    closing(db)
    calls = []
    for i in range(6):
        hidden, triples = batch(1 + i % 3, 2, seed=10 + i)
        calls.append((db.enqueue(i % L, hidden, triples), hidden, triples))
    for call, hidden, triples in calls:
        assert call.wait(10) and call.valid(), call.status()
        assert_matches_reference(store, call.layer, hidden, triples, call.out)


def test_the_watchdog_releases_the_stream_of_a_killed_worker(store, channel, procs, closing):
    """SIGKILL while the stream waits: released within the death deadline, the call invalid, new calls
    refused until reconnect(); a restarted worker then serves valid calls again."""
    proc, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    closing(client)
    aborts = []
    db = StreamDoorbell(client, "cpu", deadline_s=30, on_abort=lambda *a: aborts.append(a))   # death, not timeout
    closing(db)
    hidden, triples = batch(2, 2, seed=5)
    warm = db.enqueue(0, hidden, triples)
    assert warm.wait(10) and warm.valid()
    stop_worker(proc)
    call = db.enqueue(1, hidden, triples)
    assert wait_until(lambda: db._request_seq.value == call.seq, 5)             # rung, now waiting
    time.sleep(0.05)
    assert not call.done()
    proc.signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert call.wait(DEATH_DEADLINE_S), "the stream was not released after the worker died"
    assert time.monotonic() - t0 < DEATH_DEADLINE_S
    assert not call.valid() and call.status() == "aborted" and db.failed == "dead"
    assert aborts == [("dead", call.seq, call.seq)]
    with pytest.raises(WorkerDead, match="fetch instead"):
        db.enqueue(0, hidden, triples)
    proc.wait(timeout_s=5)
    procs(store_name=store.name, channel_name=channel)
    db.reconnect(timeout_s=START_TIMEOUT_S)
    again = db.enqueue(0, hidden, triples)
    assert again.wait(10) and again.valid() and again.seq > call.seq
    assert_matches_reference(store, 0, hidden, triples, again.out)


def test_the_watchdog_gives_up_on_a_stopped_worker_after_the_deadline(store, channel, procs, closing):
    proc, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    closing(client)
    killed = []

    def kill_late_worker(reason, first, last):          # what CpuPool does with a late worker
        killed.append((reason, first, last))
        proc.signal(signal.SIGKILL)

    db = StreamDoorbell(client, "cpu", deadline_s=0.3, on_abort=kill_late_worker)
    closing(db)
    hidden, triples = batch(1, 2, seed=6)
    assert db.enqueue(0, hidden, triples).wait(10)
    stop_worker(proc)
    t0 = time.monotonic()
    calls = [db.enqueue(i % 2, hidden, triples) for i in range(3)]              # all behind the hung one
    assert calls[-1].wait(DEATH_DEADLINE_S + 0.3)
    assert 0.25 < time.monotonic() - t0 < DEATH_DEADLINE_S + 0.3
    assert [c.valid() for c in calls] == [False] * 3
    assert killed == [("timeout", calls[0].seq, calls[-1].seq)] and db.failed == "timeout"
    assert proc.wait(timeout_s=5) == -signal.SIGKILL


# ---------------------------------------------------------------------------------------------
# On the GPU: real stream memory operations
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_round_trips_match_the_reference(store, channel, procs, closing):
    _, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    closing(client)
    db = StreamDoorbell(client, "cuda", deadline_s=5)
    closing(db)
    caps = db.capabilities()
    assert caps["64_bit_stream_mem_ops"] == 1, caps
    calls = []
    for i, (t, k) in enumerate([(3, 2), (1, 1), (5, 2), (2, 0), (8, 2), (4, 2)] * 3):     # run ahead, no sync
        hidden, triples = batch(t, k, seed=20 + i, device="cuda")
        calls.append((db.enqueue(i % L, hidden, triples if k else None), hidden, triples))
    torch.cuda.synchronize()
    for call, hidden, triples in calls:
        assert call.done() and call.valid(), call.status()
        assert_matches_reference(store, call.layer, hidden, triples, call.out)
    out = torch.empty(1, H, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        hidden = torch.ones(1, H, device="cuda", dtype=torch.bfloat16)
    call = db.enqueue(0, hidden, None, out, stream=stream)                         # a non-current stream
    assert call.wait(10) and call.valid() and call.out is out and float(out.abs().max()) == 0.0


@pytest.mark.gpu
def test_gpu_watchdog_releases_the_stream_of_a_killed_worker(store, channel, procs, closing):
    proc, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    closing(client)
    db = StreamDoorbell(client, "cuda", deadline_s=30)
    closing(db)
    hidden, triples = batch(2, 2, seed=7, device="cuda")
    assert db.enqueue(0, hidden, triples).wait(10)
    done_seq = word(client.doorbell_addresses()["done_seq"])
    stop_worker(proc)
    call = db.enqueue(1, hidden, triples)
    try:
        assert wait_until(lambda: db._request_seq.value == call.seq, 10), "the stream did not ring the doorbell"
        time.sleep(0.05)
        assert not call.done()
        proc.signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert call.wait(DEATH_DEADLINE_S), "the GPU stream was not released after the worker died"
        assert time.monotonic() - t0 < DEATH_DEADLINE_S
        torch.cuda.current_stream().synchronize()
        assert not call.valid() and call.status() == "aborted" and db.failed == "dead"
    finally:
        if not call.done():                             # never leave the GPU waiting: release it by hand
            done_seq.value = max(done_seq.value, call.seq)
            torch.cuda.current_stream().synchronize()


@pytest.mark.gpu
def test_gpu_enqueue_refuses_graph_capture(store, channel, procs, closing):
    _, client = serve_channel(procs, store, channel, START_TIMEOUT_S)
    closing(client)
    db = StreamDoorbell(client, "cuda", deadline_s=5)
    closing(db)
    hidden = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16)
    graph, caught = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        try:
            db.enqueue(0, hidden)
        except RuntimeError as exc:
            caught = exc
    assert caught is not None and "CUDA graph" in str(caught)
    assert db.in_flight == 0
    call = db.enqueue(0, hidden)                         # eager still works after the refused capture
    assert call.wait(10) and call.valid()
