"""`TokenizePool`: request parsing, chat-template rendering and tokenizing off the event loop, bounded.

A few threads (`threads`, default 2) take the work; up to `max_waiting` more requests wait for one; a request
beyond that is refused at once with `TokenizerBusy` (HTTP 503 with Retry-After, gRPC RESOURCE_EXHAUSTED),
so a flood of long prompts costs bounded CPU and memory and never queues without end. The tokenizer releases
the GIL while it works (coordinator/text_codec.py), so these threads do not starve the event loop (HTTP,
/health) or the engine link's IO thread (heartbeats to the GPU worker).

Shortly after a job over a large input, and after a large request, the heap is trimmed
(glibc malloc_trim): the tokenizer's many small allocations otherwise stay in the threads' malloc arenas, and
the process keeps the peak of a flood as resident memory.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import logging
import threading
from typing import Any, Callable

log = logging.getLogger("ft.coordinator.tokenize")

DEFAULT_THREADS = 2
DEFAULT_MAX_WAITING = 16
TRIM_AFTER_BYTES = 1 << 20          # a job over this much input trims the heap when it ends
RETRY_AFTER_S = 1


class TokenizerBusy(Exception):
    """Every tokenizer thread is busy and the wait queue is full."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc malloc_trim over every arena; releases the GIL)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class TokenizePool:
    def __init__(self, threads: int = DEFAULT_THREADS, max_waiting: int = DEFAULT_MAX_WAITING):
        if threads < 1 or max_waiting < 0:
            raise ValueError(f"tokenizer threads {threads} must be >= 1 and max_waiting {max_waiting} >= 0")
        self.threads, self.max_waiting = threads, max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ft-tokenize")
        self._lock = threading.Lock()
        self._admitted = 0                 # running + waiting; released when a job ends (not when its caller goes)
        self.jobs_total = 0
        self.rejected_total = 0
        self._trim_pending = False

    @property
    def limit(self) -> int:
        return self.threads + self.max_waiting

    @property
    def in_flight(self) -> int:
        return self._admitted

    def submit(self, fn: Callable[..., Any], *args: Any, input_bytes: int = 0) -> concurrent.futures.Future:
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

        def done(_future: concurrent.futures.Future) -> None:
            self._release()
            if input_bytes > TRIM_AFTER_BYTES:
                self.trim_soon()
        future.add_done_callback(done)
        return future

    async def run(self, fn: Callable[..., Any], *args: Any, input_bytes: int = 0) -> Any:
        """fn(*args) on a tokenizer thread (call on the event loop)."""
        return await asyncio.wrap_future(self.submit(fn, *args, input_bytes=input_bytes))

    def call(self, fn: Callable[..., Any], *args: Any, input_bytes: int = 0, timeout_s: float | None = None) -> Any:
        """fn(*args) on a tokenizer thread, waited for (call from a thread other than the event loop: gRPC)."""
        return self.submit(fn, *args, input_bytes=input_bytes).result(timeout_s)

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def trim_soon(self, delay_s: float = 0.2) -> None:
        """Trim the heap in delay_s, on a timer thread (once a large request's buffers are freed); coalesced."""
        with self._lock:
            if self._trim_pending:
                return
            self._trim_pending = True

        def trim() -> None:
            with self._lock:
                self._trim_pending = False
            trim_heap()
        timer = threading.Timer(delay_s, trim)
        timer.daemon = True
        timer.start()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
