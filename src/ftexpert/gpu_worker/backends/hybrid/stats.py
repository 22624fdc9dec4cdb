"""Counters of the hybrid backend, under the names the coordinator's policy tuner reads.

All counters are cumulative (the coordinator takes differences between snapshots, see
docs/CONTROL_PLANE.md "Engine telemetry"). Times on the GPU side come from CUDA events resolved
lazily (`StreamTimer.resolve`, no sync on the hot path); on a CPU device they are host wall times.
The device hand-off has no events inside its graphs: its join kernels time their own waits (the
GPU's global timer), folded in by DevicePath.fold_counters (device_path.py) between steps.
"""
from __future__ import annotations

import dataclasses
import time

import torch


@dataclasses.dataclass
class WorkerCounters:
    """One CPU worker's share of the work (key `cpu_workers.<name>.*`)."""
    experts_total: int = 0          # distinct experts computed, summed over layer calls
    triples_total: int = 0          # (token, expert) pairs computed
    time_s_total: float = 0.0       # compute time the worker reported
    failures_total: int = 0         # shares it did not answer (dead, deadline missed, error)
    readmissions_total: int = 0     # times it was taken back after a restart
    gpu_wait_s_total: float = 0.0   # GPU idle in its join kernel (device hand-off only; 0 on the other paths)


@dataclasses.dataclass
class HybridStats:
    calls: int = 0                          # layer forwards
    routed_pairs: int = 0                   # (token, expert) routes seen
    expert_hits_total: int = 0              # distinct routed experts found in a slot, per layer call
    expert_misses_total: int = 0            # distinct routed experts not in a slot
    experts_fetched_total: int = 0          # experts copied host -> slot (fallback fetches and prefetches included)
    experts_prefetched_total: int = 0       # of those, a prefill's next-layer prefetch (prefill_prefetch)
    copy_bytes_total: int = 0
    copy_time_s_total: float = 0.0          # copy-stream time
    cpu_experts_total: int = 0              # distinct experts computed by the CPU pool, per layer call
    cpu_triples_total: int = 0              # (token, expert) pairs computed by the CPU pool
    cpu_expert_time_s_total: float = 0.0    # compute time reported by the workers, summed
    gpu_wait_for_cpu_s_total: float = 0.0   # GPU idle at the join, waiting for CPU partial sums
    gpu_wait_for_copy_s_total: float = 0.0  # GPU idle before the expert GEMMs, waiting for copies
    # the part of gpu_wait_for_cpu_s_total measured where the copy side's wait is not (the device hand-off's
    # joins; its copies run in stream order, with no event around them): the tuner's wait term leaves it out,
    # since a one-sided wait would read as "the CPU is always the slower side"
    gpu_wait_for_cpu_unpaired_s_total: float = 0.0
    handoff_s_total: float = 0.0            # host time from the routes' readback to the last submit
    fallbacks_total: int = 0                # CPU shares fetched instead (worker dead / late / error)
    fallback_experts_total: int = 0         # experts fetched by those fallbacks
    offload_calls_total: int = 0            # layer calls run as offload (pool down, or too many tokens)
    readmissions_total: int = 0             # pool back to full strength after a fallback
    resets_after_error: int = 0             # slot cache emptied after a layer call raised (forget_slots_after_error)
    split_experts_total: int = 0            # experts split by channels between a fetch and the CPU (fetch_round split)
    split_gpu_channels_total: int = 0       # of their intermediate channels, those the GPU fetched and computed
    cpu_workers: dict[str, WorkerCounters] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def count_cpu(self, worker: str, experts: int, triples: int, seconds: float) -> None:
        """Fold an answered CPU share into the per-worker and total counters."""
        wc = self.cpu_workers[worker]
        wc.experts_total += experts
        wc.triples_total += triples
        wc.time_s_total += seconds
        self.cpu_experts_total += experts
        self.cpu_triples_total += triples
        self.cpu_expert_time_s_total += seconds


MAX_PENDING = 65536        # unresolved intervals kept before StreamTimer resolves them on its own


class StreamTimer:
    """Intervals between pairs of CUDA events, summed into HybridStats fields when resolved.

    On CUDA, `mark` records events on a stream and nothing waits for them until `resolve`
    (which the engine calls once a step, after its own sync). On the CPU, they read the host clock.
    """

    def __init__(self, on_cuda: bool, stats: HybridStats):
        self.on_cuda, self.stats = on_cuda, stats
        self._pending: list[tuple[str, object, object]] = []
        self._free: list[torch.cuda.Event] = []        # resolved events, reused (creating one costs us)

    def mark(self, stream: torch.cuda.Stream | None = None):
        """A point in time: an event recorded on `stream` (default: the current one), or the host clock."""
        if not self.on_cuda:
            return time.perf_counter()
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add(self, field: str, start, stop) -> None:
        self._pending.append((field, start, stop))
        if len(self._pending) > MAX_PENDING:      # nobody reads the counters: keep memory bounded
            self.resolve()

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event, field: str) -> None:
        """`stream` waits for `event` (CUDA), the wait timed into `field`."""
        wait_from = self.mark(stream)
        stream.wait_event(event)
        self.add(field, wait_from, self.mark(stream))

    def resolve(self) -> None:
        """Add every pending interval to its stats field (waits for events not complete yet)."""
        stats = self.stats
        for field, start, stop in self._pending:
            if self.on_cuda:
                stop.synchronize()
                seconds = start.elapsed_time(stop) / 1e3
                self._free += (start, stop)
            else:
                seconds = stop - start
            setattr(stats, field, getattr(stats, field) + max(seconds, 0.0))
        self._pending.clear()
