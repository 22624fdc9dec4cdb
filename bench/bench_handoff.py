"""Hand-off round trip through the shared-memory doorbell to a real `ft worker cpu` process.

Starts one worker (standalone, on its own cores; 0 triples, so no expert compute: the worker zeroes the
1-token partial sum) and times round trips. Expert compute time is what bench_cpu_experts.py measures.

--mode cpu: CPU <-> CPU. client.call(): submit (copy a 1-token hidden state, ring request_seq) -> the
    worker answers -> done_seq -> the client sees it. p50/p99 over --calls hot calls, then a few calls
    after idle gaps longer than the worker's hot window (the back-off's cost).
--mode gpu: GPU -> CPU process -> GPU through the device hand-off kernels (gpu_worker/backends/hybrid/device_doorbell.py,
    kernels/handoff): per call a ring kernel writes the [1, H] bf16 hidden state and the request line into the
    registered channel and moves request_seq, a join kernel spins on done_seq and adds the [1, H] fp32 partial
    sum. Each call is timed with CUDA events recorded before and after it on the stream. To time the device
    side and not Python's launch speed, calls are launched in batches behind a closed gate (a one-thread kernel
    spinning on a host word), then the gate opens and the batch runs back to back; "mean" is the batch's
    elapsed time / calls. Then GRAPH_CALLS calls captured in one CUDA graph (what a decode step replays), the
    rings and the joins alone, and for reference the host-driven round trip from the GPU side (D2H + sync,
    client.call, H2D + sync), what the host hand-off does.
--mode both (the default with CUDA): both sets of rows.

    python bench/bench_handoff.py                      # both where CUDA is available, else cpu
    python bench/bench_handoff.py --mode gpu --client-cpu 0
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from ftexpert.proto.cpu_channel import CpuPoolClient  # noqa: E402
from ftexpert.proto.shm_layout import create_worker_channel  # noqa: E402
from ftexpert.cpu_expert_pool.api import CpuWorkerProc  # noqa: E402
from ftexpert.kernels.handoff.triton_kernels import _ld_sys  # noqa: E402
from ftexpert.proto.expert_store import ExpertStore  # noqa: E402

HIDDEN = 2048              # qwen3-30b-a3b hidden size: the request carries one such row
TINY_INTERMEDIATE = 8      # the experts are never computed here (0 triples): keep the store small
START_TIMEOUT_S = 120
DEADLINE_S = 5.0
MAX_GATED_BATCH = 64       # a stream blocked on the gate accepts ~1,000 queued operations before the host
                           # blocks in a launch (a deadlock, the gate never opening); a call is ~8 of them
GRAPH_CALLS = 32           # device kernels: calls per captured graph (a decode step has 48 layers)
GATE_SAFETY_S = 30.0       # open the gate anyway after this (and say so) rather than hang


def percentiles_us(samples_ns) -> tuple[float, float, float]:
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), float(arr.max())


Row = tuple  # (label, calls, p50 us, p99 us, max us, mean us or None)


def cpu_rows(client: CpuPoolClient, args) -> list[Row]:
    rows: list[Row] = []
    hidden = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)                             # [1, H]
    empty = (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), torch.empty(0))
    samples = []
    for i in range(args.warmup + args.calls):
        t0 = time.perf_counter_ns()
        client.call(i % 2, hidden, empty, deadline_s=DEADLINE_S)     # layers alternate slots
        dt = time.perf_counter_ns() - t0
        if i >= args.warmup:
            samples.append(dt)
    rows.append(("cpu: 1 token, 0 triples, worker hot", len(samples), *percentiles_us(samples), None))
    cold = []
    for i in range(args.cold_calls):
        time.sleep(args.hot_ms / 1e3 + 0.05)
        t0 = time.perf_counter_ns()
        client.call(i % 2, hidden, empty, deadline_s=DEADLINE_S)
        cold.append(time.perf_counter_ns() - t0)
    if cold:
        rows.append((f"cpu: the same after {args.hot_ms + 50:.0f} ms idle", len(cold), *percentiles_us(cold), None))
    return rows


@triton.jit
def gate_kernel(word_addr, value):
    """Spin until the host word at word_addr (mapped host memory) reaches value."""
    v = _ld_sys(word_addr, True)
    while v < value:
        v = _ld_sys(word_addr, True)


class Gate:
    """A host word the stream waits on (gate_kernel: >= n): close() before launching a batch, open() after.
    A timer opens it for good after GATE_SAFETY_S (then `tripped` is set)."""

    def __init__(self, drv, device):
        from ftexpert.gpu_worker.backends.hybrid.device_doorbell import PinnedWords

        self.words = PinnedWords(64, cuda_driver=drv, device=device, what="benchmark gate")
        self.word = self.words.word(0)
        self.value = 0
        self.tripped = False
        self._timer: threading.Timer | None = None
        gate_kernel[(1,)](self.words.dptr(0), 0)      # loaded now: a first launch behind a closed gate would wait
        torch.cuda.synchronize()

    def close(self, stream) -> None:
        self.value += 1
        self.word.value = self.value - 1      # after a trip the word was left high: every wait would pass
        with torch.cuda.stream(stream):
            gate_kernel[(1,)](self.words.dptr(0), self.value)
        self._timer = threading.Timer(GATE_SAFETY_S, self._trip)
        self._timer.daemon = True
        self._timer.start()

    def _trip(self) -> None:
        self.tripped = True
        self.word.value = 1 << 62

    def open(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.word.value = max(self.word.value, self.value)

    def release(self) -> None:
        self.words.close()


def gated_rows(enqueue, invalid, gate, args, label: str) -> list[Row]:
    """Per-call CUDA event times of `enqueue(k)` calls run back to back behind the gate, and the batch mean.
    invalid() -> how many of the calls failed (checked after the last batch)."""
    stream = torch.cuda.current_stream()
    total = args.warmup + args.calls
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    batch = max(1, min(args.batch, MAX_GATED_BATCH))
    # One call first, ungated: a kernel's first launch loads its module, which waits for the device to be
    # idle, and a stream held by the gate is never idle (the gate's safety timer would trip).
    enqueue(0)
    stream.synchronize()
    gate.tripped = False
    spans: list[tuple[int, int]] = []
    i = 0
    while i < total:
        n = min(batch, total - i)
        gate.close(stream)
        for k in range(i, i + n):
            starts[k].record(stream)
            enqueue(k)
            ends[k].record(stream)
        gate.open()
        stream.synchronize()
        spans.append((i, i + n - 1))
        i += n
    bad = invalid()
    per_call = [starts[k].elapsed_time(ends[k]) * 1e6 for k in range(args.warmup, total)]      # ns
    measured = [(a, b) for a, b in spans if a >= args.warmup]
    mean_us = (sum(starts[a].elapsed_time(ends[b]) for a, b in measured) * 1e3
               / max(sum(b - a + 1 for a, b in measured), 1))
    note = f"{label}{' (GATE TRIPPED)' if gate.tripped else ''}{f' ({bad} INVALID)' if bad else ''}"
    return [(note, len(per_call), *percentiles_us(per_call), mean_us)]


def device_rows(client: CpuPoolClient, device, gate, hidden, args) -> list[Row]:
    """The device hand-off kernels (gpu_worker/backends/hybrid/device_doorbell.py): ring + join per call, gated,
    then GRAPH_CALLS calls captured in one CUDA graph (what a decode step replays)."""
    from ftexpert.gpu_worker.backends.hybrid.device_doorbell import DeviceDoorbell

    db = DeviceDoorbell(client, device, deadline_s=DEADLINE_S, always_ring=True)    # 0 triples, as the others
    rows: list[Row] = []
    try:
        ids = torch.full((1, 1), -1, dtype=torch.int32, device=device)             # no route: 0 triples
        weights = torch.zeros(1, 1, device=device)
        src = torch.zeros(1, HIDDEN, device=device)
        out = torch.empty(1, HIDDEN, device=device)

        ring_args, join_args = (hidden, ids, ids, weights), (src, out)

        def call(k: int) -> None:
            db.ring(k % 2, *ring_args)
            db.join(k % 2, *join_args)

        seq0 = int(client._words.done_seq[0])
        rows += gated_rows(call, lambda: db.counters()["failed"], gate, args,
                           "gpu device kernels (ring + join), per call")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for k in range(GRAPH_CALLS):
                call(k)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k in range(GRAPH_CALLS):
                call(k)
        replays = max(1, args.calls // GRAPH_CALLS)
        per_call = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(replays + 10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if r >= 10:
                per_call.append(start.elapsed_time(end) * 1e6 / GRAPH_CALLS)                 # ns
        c = db.counters()
        answered = int(client._words.done_seq[0]) - seq0
        label = f"gpu device kernels, CUDA graph of {GRAPH_CALLS} (per-replay mean)"
        bad = f" ({c['failed']} INVALID)" if c["failed"] else ""
        rows.append((f"{label}{bad}", replays * GRAPH_CALLS,
                     *percentiles_us(per_call), float(np.mean(per_call)) / 1e3))
        if answered < (replays + 10) * GRAPH_CALLS:
            raise RuntimeError(f"only {answered} requests answered")
        rows.append(("  of which: the worker's time per request (its compute_ns)", c["answered"],
                     float("nan"), float("nan"), float("nan"), c["compute_ns"] / max(c["answered"], 1) / 1e3))
        rows += [decomposed(db, call, ring_args, join_args, replays, which) for which in ("ring", "join")]
    finally:
        db.close()
    return rows


def decomposed(db, call, ring_args: tuple, join_args: tuple, replays: int, which: str) -> Row:
    """A CUDA graph of GRAPH_CALLS rings alone, or of GRAPH_CALLS joins of calls already answered (no wait):
    the GPU side's own cost per call, to set beside the full round trip."""
    def one(k: int) -> None:
        if which == "ring":
            db.ring(k % 2, *ring_args)
        else:
            db.join(k % 2, *join_args)

    for k in range(2):
        call(k)                                  # both slots rung and answered
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(GRAPH_CALLS):
            one(k)
    per_call = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(replays + 10):
        if which == "join":
            for k in range(2):
                call(k)                          # fresh answered calls in both slots (outside the timing)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if which == "ring":
            time.sleep(0.0005)                   # let the worker answer the rings before the next replay
        if r >= 10:
            per_call.append(start.elapsed_time(end) * 1e6 / GRAPH_CALLS)
    label = (f"  of which: {GRAPH_CALLS} rings alone (graph)" if which == "ring"
             else f"  of which: {GRAPH_CALLS} joins, already answered (graph)")
    return (label, replays * GRAPH_CALLS, *percentiles_us(per_call), float(np.mean(per_call)) / 1e3)


def gpu_rows(client: CpuPoolClient, args) -> tuple[list[Row], list[str]]:
    from ftexpert.kernels.cuda_driver import driver

    device = torch.device("cuda", torch.cuda.current_device())
    rows: list[Row] = []
    notes: list[str] = []
    if not client.pin_for_cuda():
        raise RuntimeError("cudaHostRegister of the channel failed")
    stream = torch.cuda.current_stream()
    hidden = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=device)              # [1, H] bf16
    out = torch.empty(1, HIDDEN, dtype=torch.float32, device=device)                  # [1, H] fp32 partial

    # Reference: host-driven from the GPU side (what the host hand-off does).
    staging = torch.empty(1, HIDDEN, dtype=torch.bfloat16, pin_memory=True)
    empty = (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), torch.empty(0))
    samples = []
    for i in range(args.warmup + args.calls):
        t0 = time.perf_counter_ns()
        staging.copy_(hidden, non_blocking=True)
        stream.synchronize()
        partial = client.call(i % 2, staging, empty, deadline_s=DEADLINE_S)
        out.copy_(partial, non_blocking=True)
        stream.synchronize()
        dt = time.perf_counter_ns() - t0
        if i >= args.warmup:
            samples.append(dt)
    rows.append(("gpu host-driven: D2H+sync, submit/wait, H2D+sync", len(samples), *percentiles_us(samples), None))

    drv = driver()
    caps = drv.capabilities(device.index)
    notes.append(f"{torch.cuda.get_device_name(device)}, driver {caps['driver_version']}, "
                 f"host pointer for registered mem {caps['host_pointer_for_registered_mem']}")
    gate = Gate(drv, device)
    try:
        rows += device_rows(client, device, gate, hidden, args)
    except Exception as exc:  # keep the other rows
        notes.append(f"device kernels: FAILED {type(exc).__name__}: {exc}")
    finally:
        gate.release()
    return rows, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("cpu", "gpu", "both"), default=None,
                        help="default: both where CUDA is available, else cpu")
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32,
                        help=f"gpu: calls per gated batch (at most {MAX_GATED_BATCH})")
    parser.add_argument("--client-cpu", type=int, default=None,
                        help="pin this process to this CPU and keep it out of the worker's set")
    parser.add_argument("--hot-ms", type=float, default=50.0, help="worker: spin this long after a request")
    parser.add_argument("--cold-calls", type=int, default=20, help="cpu: calls after an idle gap > hot window")
    args = parser.parse_args()
    mode = args.mode or ("both" if torch.cuda.is_available() else "cpu")
    if mode != "cpu" and not torch.cuda.is_available():
        print("--mode gpu/both needs CUDA (torch sees no GPU); use --mode cpu", file=sys.stderr)
        return 2

    tag = os.getpid()
    store = ExpertStore.create(f"ft-bench-handoff-{tag}", num_layers=2, num_experts=8, hidden=HIDDEN,
                               intermediate=TINY_INTERMEDIATE, dtype=torch.bfloat16, config_hash="bench")
    for layer in range(2):
        store.write_layer(layer, torch.zeros(8, store.shape.expert_numel, dtype=torch.bfloat16))
    store.mark_ready()
    chan_name = f"ft-bench-handoff-{tag}.cpu0"
    chan = create_worker_channel(chan_name, t_max=16, hidden=HIDDEN, max_triples=128)
    worker_args = ["--threads", "1", "--hot-ms", str(args.hot_ms), "--no-warmup", "--log-level", "WARNING"]
    if args.client_cpu is not None:
        os.sched_setaffinity(0, {args.client_cpu})
        worker_args += ["--reserve-cpus", str(args.client_cpu)]
        env = dict(os.environ)
    else:
        env = None
    proc = CpuWorkerProc(store_name=store.name, channel_name=chan_name, extra_args=worker_args, env=env)
    # The child inherits our affinity; widen it back so the worker's own plan can use its cores.
    if args.client_cpu is not None:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        proc.start()
        os.sched_setaffinity(0, {args.client_cpu})
    else:
        proc.start()
    client = CpuPoolClient(chan_name)
    rows: list[Row] = []
    notes: list[str] = []
    try:
        client.wait_for_worker(timeout_s=START_TIMEOUT_S)
        if mode in ("cpu", "both"):
            rows += cpu_rows(client, args)
        if mode in ("gpu", "both"):
            gpu, notes = gpu_rows(client, args)
            rows += gpu
    finally:
        client.close()
        proc.stop(timeout_s=10)
        chan.close()
        chan.unlink()
        store.close()
        store.unlink()
    print(f"worker pid {proc.pid}, client affinity {sorted(os.sched_getaffinity(0))}, {os.cpu_count()} CPUs, "
          f"mode {mode}")
    for note in notes:
        print(note)
    print()
    print(f"{'round trip (1 token, H=2048, 0 triples)':<52} {'calls':>6} {'p50 us':>8} {'p99 us':>8} {'max us':>8} "
          f"{'mean us':>8}")
    for label, n, p50, p99, worst, mean in rows:
        cells = " ".join("       -" if v != v else f"{v:>8.1f}" for v in (p50, p99, worst))
        print(f"{label:<52} {n:>6} {cells} {'       -' if mean is None else f'{mean:>8.1f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
