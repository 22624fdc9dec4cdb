"""CPU lists and process-wide affinity, shared by the three processes.

The `--reserve-cpus` / `--allowed-cpus` flags carry CPU lists in the kernel's format ('0-3,8-11'): the
coordinator resolves them once, the CPU workers are placed within them (cpu_expert_pool/topology.py),
and the GPU worker pins itself to the reserved ones with `set_process_affinity` (every thread).
"""
from __future__ import annotations

import os
from typing import Iterable

RESERVE_CPU_MIN_CPUS = 4              # from this many CPUs on, CPU 0 is left to the GPU-driving process


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8-11' -> (0, 1, 2, 3, 8, 9, 10, 11); '' -> (); also accepts strides '0-6:2'."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                span, _, stride = part.partition(":")
                lo, hi = (int(x) for x in span.split("-"))
                if hi < lo:
                    raise ValueError
                cpus.update(range(lo, hi + 1, int(stride) if stride else 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise ValueError(f"bad CPU list {text!r} at {part!r}; expected e.g. '0-3,8-11'") from None
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8'."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def thread_ids() -> list[int]:
    """The ids of this process's threads (/proc/self/task)."""
    return sorted(int(tid) for tid in os.listdir("/proc/self/task"))


def set_process_affinity(cpus: Iterable[int]) -> int:
    """Set the CPU affinity of every thread of this process; returns how many threads were set.

    Linux's sched_setaffinity(0) sets the calling thread only (a new thread inherits its creator's
    mask, a child process the forking thread's), so the threads already running (IO, heartbeat,
    watchdog, supervisor threads) are set one by one from /proc/self/task, again until no new one has
    appeared meanwhile. A thread that exits meanwhile is skipped. The mask may be wider than the current
    one, within the cgroup's cpuset."""
    cpus = tuple(cpus)
    done: set[int] = set()
    while True:
        todo = [tid for tid in thread_ids() if tid not in done]
        if not todo:
            return len(done)
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:       # exited since the listing
                pass
            done.add(tid)


def default_reserved_cpus(affinity: Iterable[int]) -> str:
    """The CPUs kept free of CPU workers when none are given: CPU 0 on machines with >= 4 CPUs, else none."""
    return "0" if len(set(affinity)) >= RESERVE_CPU_MIN_CPUS else ""
