"""Bandwidth measurements behind `ft bench bw`, and the profile file they go to (docs/POLICY.md schema).

- `copy_bandwidth`: host -> device copies of one expert from the expert store (CUDA events; the store
  pinned with cudaHostRegister, as the offload and hybrid backends use it). On a CPU device: host
  memcpy store -> slot buffer, which is what those backends' "fetch" is there.
- `cpu_pool_bandwidth`: the CPU pool's expert throughput through real `ft worker cpu` processes, the
  real kernel and the real channel: 1 token x top_k distinct experts per call (a decode step's CPU
  share), weight bytes / round-trip time. Each call reads experts no earlier call touched recently.
- `shared_bandwidth`: both at once, as the hybrid backend runs them: the copies on a thread of their
  own while the CPU pool calls run, each side's rate inside their common window and the bytes both
  moved in it. Alone, each side has the host DRAM to itself; together they share it, and B_pcie + B_cpu
  from the two above overstates the hybrid roofline.
- `write_profile_entry`: merge one entry, keyed on (gpu_name, dtype, H, I, format), into the profile JSON.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable, Iterator

import numpy as np
import torch

from ftexpert.cpu_expert_pool.api import CpuWorkerProc
from ftexpert.kernels.expert_reference import quantize_expert
from ftexpert.proto.cpu_channel import CpuPoolClient
from ftexpert.proto.expert_format import ExpertFormat
from ftexpert.proto.expert_owners import ExpertSplit
from ftexpert.proto.expert_store import ExpertStore, StoreShape
from ftexpert.proto.shm_layout import channel_hidden_dtype, create_worker_channel

WARMUP_CALLS = 10
BENCH_DISTINCT = 8          # quantized bench stores: experts quantized, their bytes repeated (the copies read them all)
WARMUP_S = 0.3              # CPU pool: calls for at least this long before timing (a fresh worker settles)
WORKER_START_TIMEOUT_S = 120.0
CALL_DEADLINE_S = 30.0
# shared_bandwidth
COPY_BATCH = 8              # experts a copy batch (timed as one)
COPY_QUEUE_OPS = 256        # CUDA: copies + events queued ahead of the stream at most
COPY_LEAD_S = 0.2           # the copies run this long before the CPU window opens
COPY_START_TIMEOUT_S = 30.0
COPY_JOIN_TIMEOUT_S = 60.0
SHARED_WINDOW_MIN_S = 0.1   # the CPU window lasts at least this long: many copy batches, and many GIL
                            # switch intervals (5 ms; the pool client spins holding the GIL)
MIN_SHARED_SAMPLES = 3      # copy batches inside the window, and CPU calls, at the least
SHARED_SWITCH_INTERVAL_S = 1e-4   # the GIL's switch interval while the window lasts (restored after)


@dataclasses.dataclass
class Measurement:
    gb_s: float              # median
    p10_gb_s: float          # the slow tail (10th percentile of bandwidth)
    calls: int


def bench_store(hidden: int, intermediate: int, dtype: torch.dtype, store_bytes: int, min_experts: int,
                seed: int = 0, fmt: str = "bf16") -> ExpertStore:
    """A one-layer store of random experts, at least `store_bytes` (beyond the last-level cache), in the expert
    format `fmt` (quantized: BENCH_DISTINCT experts quantized, their bytes repeated over the store)."""
    probe = StoreShape(1, 1, hidden, intermediate, str(dtype).removeprefix("torch."), ExpertFormat.parse(fmt).label)
    num = max(min_experts, -(-store_bytes // probe.expert_bytes))
    store = ExpertStore.create(f"ft-benchbw-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=1, num_experts=num,
                               hidden=hidden, intermediate=intermediate, dtype=dtype, config_hash="bench-bw",
                               fmt=probe.fmt)
    gen = torch.Generator().manual_seed(seed)
    view = store.layer_view(0)                                                    # [E, N]
    if store.expert_format.quantized:
        distinct = torch.stack([quantize_expert(*(torch.randn(r, k, generator=gen) * 0.02 for r, k in
                                                  ((intermediate, hidden), (intermediate, hidden),
                                                   (hidden, intermediate))), store.expert_format)
                                for _ in range(min(BENCH_DISTINCT, num))])        # [D, N] bytes
        for start in range(0, num, distinct.shape[0]):
            view[start:start + distinct.shape[0]] = distinct[:num - start]
    else:
        for start in range(0, num, 64):
            view[start:start + 64].normal_(0.0, 0.02, generator=gen)
    store.mark_ready()
    return store


def _measurement(nbytes: int, seconds: list[float]) -> Measurement:
    return Measurement(nbytes / statistics.median(seconds) / 1e9,
                       nbytes / float(np.percentile(seconds, 90)) / 1e9, len(seconds))


def copy_bandwidth(store: ExpertStore, device: torch.device, calls: int) -> Measurement:
    """One expert a copy, store -> device buffer, cycling through the store's experts."""
    layer = store.layer_view(0)                                                   # [E, N]
    dst = torch.empty(layer.shape[1], dtype=layer.dtype, device=device)          # [N]
    times = []
    if device.type == "cuda":
        store.pin_for_cuda()
        stream = torch.cuda.current_stream(device)
        for i in range(WARMUP_CALLS + calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(layer[i % layer.shape[0]], non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for i in range(WARMUP_CALLS + calls):
            t0 = time.perf_counter()
            dst.copy_(layer[i % layer.shape[0]])
            times.append(time.perf_counter() - t0)
    return _measurement(store.expert_bytes, times[WARMUP_CALLS:])


@contextlib.contextmanager
def _bench_pool(store: ExpertStore, *, top_k: int, num_workers: int, worker_flags: list[str],
                log_dir: str | None) -> Iterator[Callable[[], tuple[float, float]]]:
    """`num_workers` real workers of their own (channels "<store>.bw<w>", so a pool serving the store is
    left alone), warmed up, as a function that makes one timed call: 1 token x top_k distinct experts of
    layer 0 no earlier call touched recently -> (its round-trip seconds, the slowest worker's kernel seconds). Workers and channels are gone
    when the block is left, however it is left."""
    num = store.num_experts
    split = ExpertSplit.contiguous(1, num, num_workers)
    hidden_dtype = channel_hidden_dtype(store.dtype)
    segments, procs, clients = [], [], []
    try:
        for w in range(num_workers):
            name = f"{store.name}.bw{w}"
            segments.append(create_worker_channel(name, t_max=1, hidden=store.shape.hidden, max_triples=top_k,
                                                  hidden_dtype=hidden_dtype))
            log_path = os.path.join(log_dir, f"bench-bw-worker{w}.log") if log_dir else None
            procs.append(CpuWorkerProc(store_name=store.name, channel_name=name, worker_index=w,
                                       num_workers=num_workers, extra_args=worker_flags, log_path=log_path).start())
            clients.append(CpuPoolClient(name))
        for client in clients:
            client.wait_for_worker(timeout_s=WORKER_START_TIMEOUT_S)
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(1, store.shape.hidden, generator=gen).to(torch.bfloat16 if hidden_dtype == "bfloat16"
                                                                       else torch.float32)
        weight = np.full(top_k, 1.0 / top_k, dtype=np.float32)
        token = np.zeros(top_k, dtype=np.int32)
        i = 0

        def call() -> tuple[float, float]:
            nonlocal i
            experts = ((i * top_k + np.arange(top_k)) % num).astype(np.int32)   # fresh experts every call
            i += 1
            parts = split.split_triples(0, experts)
            t0 = time.perf_counter()
            for client, rows in zip(clients, parts):
                if rows.size:
                    client.submit(0, hidden, (token[rows], experts[rows], weight[rows]))   # layer 0
            for client, rows in zip(clients, parts):
                if rows.size:
                    client.wait(0, deadline_s=CALL_DEADLINE_S)
            elapsed = time.perf_counter() - t0
            kernel = max(client.last_compute_ns(0) for client, rows in zip(clients, parts) if rows.size) / 1e9
            return elapsed, kernel

        warm_until = time.perf_counter() + WARMUP_S          # a fresh worker settles
        while i < WARMUP_CALLS or time.perf_counter() < warm_until:
            call()
        yield call
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            proc.stop(timeout_s=10)
        for seg in segments:
            seg.close()
            seg.unlink()


def cpu_pool_bandwidth(store: ExpertStore, *, top_k: int, calls: int, num_workers: int, worker_flags: list[str],
                       log_dir: str | None = None) -> Measurement:
    """Round trips of 1-token calls over top_k distinct experts of layer 0 through `num_workers` real
    workers of their own (channels "<store>.bw<w>", so a pool serving the store is left alone)."""
    with _bench_pool(store, top_k=top_k, num_workers=num_workers, worker_flags=worker_flags,
                     log_dir=log_dir) as call:
        times = [call()[0] for _ in range(calls)]
    return _measurement(top_k * store.expert_bytes, times)


@dataclasses.dataclass
class SharedMeasurement:
    """Both sides at once: what each gets while the other runs (they read one host DRAM)."""
    pcie: Measurement        # copy batches that lay wholly inside the CPU window (calls = batches)
    cpu: Measurement         # the CPU pool calls, which make the window
    window_s: float          # the CPU window on the host's clock
    copy_window_s: float     # the same window on the copies' clock (CUDA events; on the CPU the host's)
    pcie_bytes: float        # copied inside the window (batches cut by its edges count pro rata)
    cpu_bytes: int           # the calls' expert bytes
    cpu_kernel: Measurement  # the same calls' bytes over the workers' own kernel time (compute_ns): what the
                             # DRAM gave the kernel, without this process's side of the round trip

    @property
    def combined_gb_s(self) -> float:
        """Bytes both sides moved inside the common window a second (each side over its own clock's window)."""
        return (self.pcie_bytes / self.copy_window_s + self.cpu_bytes / self.window_s) / 1e9

    @property
    def pcie_busy(self) -> float:
        """About the share of the window the copies ran (bytes copied / their batches' median rate): near 1
        when the copy loop kept its stream fed, as the measurement needs (batch rates vary: it can pass 1)."""
        return self.pcie_bytes / (self.pcie.gb_s * 1e9 * self.copy_window_s)

    @property
    def fetch_fraction(self) -> float:
        """The f these figures would give (the policy starts from the separate ones: docs/POLICY.md)."""
        return self.pcie.gb_s / (self.pcie.gb_s + self.cpu.gb_s)

    def fields(self) -> dict:
        """The profile's / a benchmark JSON's keys for these figures (docs/POLICY.md)."""
        return {"pcie_shared_gb_s": round(self.pcie.gb_s, 3), "cpu_shared_gb_s": round(self.cpu.gb_s, 3),
                "cpu_shared_kernel_gb_s": round(self.cpu_kernel.gb_s, 3), "shared_gb_s": round(self.combined_gb_s, 3),
                "shared_pcie_busy": round(self.pcie_busy, 3), "shared_window_s": round(self.window_s, 4)}

    def summary(self) -> str:
        return (f"copy {self.pcie.gb_s:.1f} GB/s, CPU pool {self.cpu.gb_s:.1f} GB/s (its kernels "
                f"{self.cpu_kernel.gb_s:.1f}), {self.combined_gb_s:.1f} GB/s together over {self.window_s * 1e3:.0f} "
                f"ms, copies busy {self.pcie_busy:.0%} of it (these figures would give f = {self.fetch_fraction:.3f})")


class _CopyLoop(threading.Thread):
    """Copies store -> device buffer in batches of COPY_BATCH experts, cycling through the store, until
    stopped; each batch's start and end are kept, on a clock `mark()` also reads.

    CUDA: a stream of its own, one `copy_(non_blocking=True)` a batch (one a row where the layer's rows are not
    contiguous; copy_bandwidth copies the same way, one expert at a time), an event before
    and after each batch (were the stream to run dry, the idle time between batches is not counted as
    copying). The host runs up to COPY_QUEUE_OPS operations ahead (it waits on the end event of the batch
    that many operations back): never blocked on a full launch queue, and the stream does not run dry
    while the host waits for the GIL (the CPU pool calls run on the main thread). The events are
    blocking-sync ones, so this thread sleeps rather than spins: a spinning core would be taken from the
    CPU workers measured beside it. `mark()` records an event on another, idle stream: it completes at
    once, so its GPU time stamps that host moment on the copies' clock. Without CUDA: host memcpy (torch's
    copy_ releases the GIL), each batch timed with perf_counter at both ends, and `mark()` is perf_counter."""

    def __init__(self, store: ExpertStore, device: torch.device):
        super().__init__(name="ft-bench-bw-copy", daemon=True)
        self.layer = store.layer_view(0)                                          # [E, N]
        self.device = device
        self.cuda = device.type == "cuda"
        rows = min(COPY_BATCH, self.layer.shape[0])
        self.dst = torch.empty((rows, self.layer.shape[1]), dtype=self.layer.dtype, device=device)   # [B, N]
        # One copy call a batch where the layer's rows are contiguous (the GIL is taken once a batch, not once an
        # expert: the pool client beside it spins holding the GIL); else one a row.
        self.whole_batches = self.layer.is_contiguous() and self.layer.shape[0] >= COPY_BATCH
        self._next = 0
        self.batch_bytes = COPY_BATCH * store.expert_bytes
        self.stop_requested = threading.Event()
        self.running = threading.Event()              # set once a batch is issued (or the loop failed)
        self.error: BaseException | None = None
        self.batches: list[tuple] = []                # (start, end) per batch: CUDA events, or perf_counter s
        if self.cuda:
            store.pin_for_cuda()
            self.stream = torch.cuda.Stream(device)
            self.marker_stream = torch.cuda.Stream(device)

    def _event(self) -> "torch.cuda.Event":
        return torch.cuda.Event(enable_timing=True, blocking=True)

    def run(self) -> None:
        try:
            self._run_cuda() if self.cuda else self._run_host()
        except BaseException as exc:                  # handed to the caller after join()
            self.error = exc
        finally:
            self.running.set()                        # a failure must not leave the caller waiting

    def _copy_batch(self, non_blocking: bool = False) -> None:
        """The next COPY_BATCH experts of the layer (cycling) into the device buffer."""
        num = self.layer.shape[0]
        if self.whole_batches:
            start = self._next % (num - num % COPY_BATCH)
            self.dst.copy_(self.layer[start:start + COPY_BATCH], non_blocking=non_blocking)
        else:
            for j in range(COPY_BATCH):
                self.dst[j % self.dst.shape[0]].copy_(self.layer[(self._next + j) % num], non_blocking=non_blocking)
        self._next += COPY_BATCH

    def _run_cuda(self) -> None:
        depth = max(1, COPY_QUEUE_OPS // (COPY_BATCH + 2))       # batches in flight: copies + two events each
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            while not self.stop_requested.is_set():
                if len(self.batches) >= depth and not self.batches[-depth][1].query():
                    self.batches[-depth][1].synchronize()     # releases the GIL: only when it must wait
                start, end = self._event(), self._event()
                start.record(self.stream)
                self._copy_batch(non_blocking=True)
                end.record(self.stream)
                self.batches.append((start, end))
                self.running.set()
            self.stream.synchronize()

    def _run_host(self) -> None:
        while not self.stop_requested.is_set():
            start = time.perf_counter()
            self._copy_batch()
            self.batches.append((start, time.perf_counter()))
            self.running.set()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._event()
        event.record(self.marker_stream)
        return event

    def stop(self) -> bool:
        """Ask the loop to stop and wait for it; False when it did not stop in time (the caller raises, after
        its own cleanup: raising here, inside a finally, would hide the error that got it there)."""
        self.stop_requested.set()
        if self.is_alive():
            self.join(timeout=COPY_JOIN_TIMEOUT_S)
        return not self.is_alive()

    def spans(self, window_start, window_end) -> tuple[float, list[tuple[float, float]]]:
        """(window length, [(start, end) of each batch]) in seconds from the window's start; after stop()."""
        if not self.batches:
            return 0.0, []
        if self.cuda:
            window_end.synchronize()
            origin = self.batches[0][0]               # recorded before the markers: elapsed times stay >= 0

            def at(event) -> float:
                return origin.elapsed_time(event) / 1e3
        else:
            def at(t: float) -> float:
                return t
        w0 = at(window_start)
        return at(window_end) - w0, [(at(s) - w0, at(e) - w0) for s, e in self.batches]


def shared_bandwidth(store: ExpertStore, device: torch.device, *, top_k: int, calls: int, num_workers: int,
                     worker_flags: list[str], log_dir: str | None = None) -> SharedMeasurement:
    """The copies of copy_bandwidth and the CPU pool calls of cpu_pool_bandwidth at the same time.

    Both read the same host memory; measured alone, B_pcie + B_cpu overstates what they get together on
    one DRAM. The copies start first (on a thread of their own) and run COPY_LEAD_S before the CPU window
    opens: `calls` back-to-back pool calls on this thread, more if they take under SHARED_WINDOW_MIN_S
    (warmed up beforehand, while no copies ran). The copy side counts the batches that lay wholly inside
    the window (their median rate), and for the combined figure the bytes copied inside it, batches cut
    by its edges pro rata. Raises RuntimeError when fewer than MIN_SHARED_SAMPLES batches fall inside the
    window or the copy loop fails; the thread and the workers are stopped however it ends."""
    if calls < MIN_SHARED_SAMPLES:
        raise ValueError(f"shared_bandwidth needs at least {MIN_SHARED_SAMPLES} CPU calls, got {calls}")
    with _bench_pool(store, top_k=top_k, num_workers=num_workers, worker_flags=worker_flags,
                     log_dir=log_dir) as call:
        copies = _CopyLoop(store, device)
        switch = sys.getswitchinterval()
        copies.start()
        window = None
        try:
            copies.running.wait(timeout=COPY_START_TIMEOUT_S)
            time.sleep(COPY_LEAD_S)
            if copies.error is None:
                # The pool client spins holding the GIL; at the default 5 ms switch interval the copy thread
                # could top its queue up only every 5 ms and the stream ran dry (on the H200 at that interval the
                # copies were busy ~40% of the window). A short interval while the window lasts keeps them queued.
                sys.setswitchinterval(SHARED_SWITCH_INTERVAL_S)
                call()                           # untimed: the workers went cold during the copies' lead
                window_start = copies.mark()
                t0 = time.perf_counter()
                cpu_calls: list[tuple[float, float]] = []
                while len(cpu_calls) < calls or time.perf_counter() - t0 < SHARED_WINDOW_MIN_S:
                    cpu_calls.append(call())
                window_s = time.perf_counter() - t0
                window = (window_start, copies.mark())
        finally:
            sys.setswitchinterval(switch)
            stopped = copies.stop()
    if not stopped:
        raise RuntimeError(f"the bench-bw copy thread did not stop within {COPY_JOIN_TIMEOUT_S:.0f} s")
    if copies.error is not None:
        raise RuntimeError(f"the copy loop of the shared measurement failed: {copies.error!r}") from copies.error
    if window is None or not copies.batches:
        raise RuntimeError(f"the copy loop of the shared measurement had finished no batch "
                           f"{COPY_START_TIMEOUT_S + COPY_LEAD_S:.1f} s after it started")
    copy_window_s, spans = copies.spans(*window)
    inside = [e - s for s, e in spans if s >= 0 and e <= copy_window_s]
    if len(inside) < MIN_SHARED_SAMPLES or copy_window_s <= 0:
        raise RuntimeError(f"only {len(inside)} copy batches of {COPY_BATCH} experts "
                           f"({copies.batch_bytes / 1e6:.1f} MB) lay wholly inside the {window_s * 1e3:.2f} ms CPU "
                           f"window of {len(cpu_calls)} calls (at least {MIN_SHARED_SAMPLES} needed): the copies "
                           "starved or the window was too short")
    copied = sum(copies.batch_bytes * (min(e, copy_window_s) - max(s, 0.0)) / (e - s)
                 for s, e in spans if e > 0 and s < copy_window_s and e > s)
    call_bytes = top_k * store.expert_bytes
    return SharedMeasurement(pcie=_measurement(copies.batch_bytes, inside),
                             cpu=_measurement(call_bytes, [t for t, _ in cpu_calls]), window_s=window_s,
                             copy_window_s=copy_window_s, pcie_bytes=copied, cpu_bytes=len(cpu_calls) * call_bytes,
                             cpu_kernel=_measurement(call_bytes, [k for _, k in cpu_calls]))


def write_profile_entry(path: str, entry: dict) -> dict:
    """Merge `entry` (gpu_name, dtype, hidden_size, intermediate_size, pcie_gb_s, cpu_gb_s, ...) into the
    profile at `path`, replacing an entry with the same key; atomic. Returns the whole document."""
    doc: dict = {"entries": []}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                old = json.load(fh)
            if isinstance(old, dict) and isinstance(old.get("entries"), list):
                doc = old
        except (OSError, ValueError):
            pass                                       # unreadable: replaced by a fresh document
    key = ("gpu_name", "dtype", "hidden_size", "intermediate_size", "format")
    default = {"format": "bf16"}                       # an entry written before formats were keyed is bf16's
    doc["entries"] = [e for e in doc["entries"]
                      if not (isinstance(e, dict) and all(e.get(k, doc.get(k, default.get(k))) ==
                                                          entry.get(k, default.get(k)) for k in key))]
    doc["entries"].append(entry)
    doc["gpu_name"] = entry["gpu_name"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".benchbw-", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return doc
