"""`TokenizePool`: request parsing, chat-template rendering and tokenizing off the event loop, bounded.

A few threads (`threads`, default half the CPUs this process may use, 1 to 4) take the work, at a lower
CPU priority (nice +10) than the rest of the process, so that on a loaded machine the event loop and the IO
threads run first; up to `max_waiting` more requests wait for one; a request
beyond that is refused at once with `TokenizerBusy` (HTTP 503 with Retry-After, gRPC RESOURCE_EXHAUSTED),
so a flood of long prompts costs bounded CPU and memory and never queues without end. The tokenizer releases
the GIL while it works (coordinator/text_codec.py), so these threads do not starve the event loop (HTTP,
/health) or the engine link's IO thread (heartbeats to the GPU worker).

Memory stays bounded with the work: few threads, each tokenizing at most a context's worth of an over-long
prompt (text_codec.py counts it in pieces), so a flood leaves resident memory near its baseline
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from typing import Any, Callable

log = logging.getLogger("ft.coordinator.tokenize")

DEFAULT_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 2))
THREAD_NICENESS = 10
DEFAULT_MAX_WAITING = 16
RETRY_AFTER_S = 1


class TokenizerBusy(Exception):
    """Every tokenizer thread is busy and the wait queue is full."""


def _lower_priority() -> None:
    """This thread only (a Linux thread is a task with its own nice value)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + THREAD_NICENESS))
    except (AttributeError, OSError):
        pass


class TokenizePool:
    def __init__(self, threads: int = DEFAULT_THREADS, max_waiting: int = DEFAULT_MAX_WAITING):
        if threads < 1 or max_waiting < 0:
            raise ValueError(f"tokenizer threads {threads} must be >= 1 and max_waiting {max_waiting} >= 0")
        self.threads, self.max_waiting = threads, max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ft-tokenize",
                                                               initializer=_lower_priority)
        self._lock = threading.Lock()
        self._admitted = 0                 # running + waiting; released when a job ends (not when its caller goes)
        self.jobs_total = 0
        self.rejected_total = 0

    def start_threads(self) -> None:
        """Start every thread now (the executor starts them lazily, and a start waits for the new thread:
        tens of ms on a loaded machine, which would fall on the event loop at the first requests)."""
        barrier = threading.Barrier(self.threads + 1)
        for _ in range(self.threads):
            self._executor.submit(barrier.wait, 10.0)
        barrier.wait(10.0)

    @property
    def limit(self) -> int:
        return self.threads + self.max_waiting

    @property
    def in_flight(self) -> int:
        return self._admitted

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue fn(*args); TokenizerBusy when `limit` jobs are already running or waiting."""
        with self._lock:
            if self._admitted >= self.limit:
                self.rejected_total += 1
                raise TokenizerBusy(f"the tokenizer is busy ({self._admitted} requests are being tokenized or "
                                    f"waiting, the limit); retry in {RETRY_AFTER_S} s")
            self._admitted += 1
            self.jobs_total += 1
        try:
            future = self._executor.submit(fn, *args)
        except RuntimeError:               # shut down
            self._release()
            raise TokenizerBusy("the server is shutting down; retry against another replica") from None
        future.add_done_callback(lambda _f: self._release())
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a tokenizer thread (call on the event loop)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """fn(*args) on a tokenizer thread, waited for (call from a thread other than the event loop: gRPC)."""
        return self.submit(fn, *args).result(timeout_s)

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
