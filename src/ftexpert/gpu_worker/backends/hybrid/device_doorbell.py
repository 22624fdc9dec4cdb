"""`DeviceDoorbell`: one CPU worker's channel driven by the device hand-off kernels (kernels/handoff).

    db = DeviceDoorbell(client, device, member=0, fail=fail_flag, deadline_s=1.0)
    db.ring(layer, x, ids, routes, weights, owner=owner_map)   # after ensure: the routes at -1 go to the worker
    ...                                                         # copies and GPU GEMMs meanwhile
    db.join(layer, gpu_part, total)                             # total = gpu_part + the worker's partial sums
    ...                                                         # after the step (a stream sync):
    code = db.failure()                                         # 0, or FAIL_TIMEOUT / FAIL_ABORTED / FAIL_STATUS

Both calls are single kernel launches with no host synchronisation, so a decode step that uses them
is capturable in a CUDA graph and each replay rings fresh sequence numbers (the ring kernel reads
the channel's request_seq itself). The worker's side of the protocol is unchanged
(proto/shm_layout.py). What the host still does, off the hot path:

- the watchdog (the process-wide `DoorbellWatchdog` below) looks at the channel's
  request_seq / done_seq in host memory; when a rung request's worker is dead (pidfd) or the request
  is older than `deadline_s`, it raises the doorbell's abort word, which every spinning join kernel
  reads, and calls `on_abort` (the pool kills a late worker). The join kernel has its own deadline
  too (the GPU's global timer), so a GPU never spins forever even without the watchdog;
- after the step, `failure()` reads the host-visible failure word the join kernel set (a failure
  code of the step; the kernel also sets the shared device flag so later rings of the step are
  no-ops); `reset()` clears them before the step is re-run by fetching.

Without CUDA the same kernels run in the Triton interpreter on the host mapping (TRITON_INTERPRET=1:
how CI tests the protocol against real worker processes).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
import weakref
from typing import Callable

import numpy as np
import torch

from ftexpert.proto.cpu_channel import CpuPoolClient, WorkerDead
from ftexpert.kernels import handoff
from ftexpert.kernels.cuda_driver import CudaDriver, CudaDriverUnavailable, driver
from ftexpert.proto.shm_layout import (CACHE_LINE_BYTES, NUM_SLOTS, PAGE_BYTES, REQUEST_SEQ_OFFSET, SLOT_LINES_BYTES,
                              SLOT_LINES_OFFSET)
from ftexpert.proto.shm_segment import cuda_host_register, cuda_host_unregister

log = logging.getLogger(__name__)

ABORT_OFFSET = 0                 # int64 words of the doorbell's own registered page (own cache lines)
HOST_FAIL_OFFSET = CACHE_LINE_BYTES
FAIL_REASONS = {handoff.FAIL_TIMEOUT: "timeout", handoff.FAIL_ABORTED: "aborted", handoff.FAIL_STATUS: "error status",
                handoff.FAIL_REPLACED: "replaced (a restarted worker claimed the channel)"}
ABORT_DEAD, ABORT_LATE = 1, 2    # what the watchdog writes into the abort word


class PinnedWords:
    """`nbytes` of page-aligned host memory of our own, registered (portable | mapped) for CUDA when a driver is
    given, whose 8-byte words a kernel may read or write (``dptr``) and the host too (``word``)."""

    def __init__(self, nbytes: int, *, cuda_driver: CudaDriver | None, device: torch.device | None, what: str):
        self.nbytes = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        self._mm = mmap.mmap(-1, self.nbytes)
        self.u8 = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(self.u8.ctypes.data)
        self.registered = False
        self.device_address = self.address
        if cuda_driver is not None:
            self.registered = cuda_host_register(self.address, self.nbytes, what=what)
            if not self.registered:
                raise CudaDriverUnavailable(f"cannot register {what} for CUDA (torch sees no GPU)")
            with torch.cuda.device(device):
                self.device_address = cuda_driver.device_pointer(self.address)

    def word(self, offset: int) -> ctypes.c_int64:
        return ctypes.c_int64.from_address(self.address + offset)

    def dptr(self, offset: int) -> int:
        return self.device_address + offset

    def close(self) -> None:
        if self.registered:
            cuda_host_unregister(self.address)
            self.registered = False


class DeviceDoorbell:
    """One pool member's channel for the device hand-off kernels (see the module docstring).

    client: a CpuPoolClient (connected: its worker's pidfd is what the watchdog checks); member: the
    index in the owner map; fail: [1] int32 device flag shared by every doorbell of one backend;
    always_ring: ring even with no triple (benchmarks of the bare round trip)."""

    def __init__(self, client: CpuPoolClient, device: torch.device | str, *, member: int = 0,
                 fail: torch.Tensor | None = None, deadline_s: float = 1.0, watchdog: bool = True,
                 poll_s: float = 500e-6, on_abort: Callable[[str, int, int], None] | None = None,
                 always_ring: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.on_cuda = self.device.type == "cuda"
        if not client.connected:
            raise WorkerDead(f"channel {client.name!r} has no connected CPU worker; call wait_for_worker() first")
        self.client, self.layout, self.member = client, client.layout, member
        self.poll_s, self.on_abort, self.always_ring = poll_s, on_abort, always_ring
        self.hidden_bf16 = self.layout.hidden_dtype == "bfloat16"
        drv = None
        if self.on_cuda:
            drv = driver()
            with torch.cuda.device(self.device):
                torch.cuda.current_stream(self.device).synchronize()      # the primary context is current
                if not client.pin_for_cuda():
                    raise RuntimeError(f"channel {client.name!r} could not be registered for CUDA")
        self._words = PinnedWords(2 * CACHE_LINE_BYTES, cuda_driver=drv, device=self.device,
                                  what=f"device doorbell words of {client.name!r}")
        self._abort = self._words.word(ABORT_OFFSET)
        self._host_fail = self._words.word(HOST_FAIL_OFFSET)
        doorbell = client.doorbell_addresses()
        base = doorbell["request_seq"] - REQUEST_SEQ_OFFSET
        self._request_seq = ctypes.c_int64.from_address(doorbell["request_seq"])
        self._done_seq = ctypes.c_int64.from_address(doorbell["done_seq"])

        def dev(address: int) -> int:
            if drv is None:
                return address
            with torch.cuda.device(self.device):
                return drv.device_pointer(address)

        common = {"request_seq": dev(doorbell["request_seq"]), "done_seq": dev(doorbell["done_seq"]),
                  "abort": self._words.dptr(ABORT_OFFSET), "host_fail": self._words.dptr(HOST_FAIL_OFFSET)}
        self._addrs = []
        for s in range(NUM_SLOTS):
            slot = {name: dev(addr) for name, addr in client.slot_addresses(s).items()}
            slot["line"] = dev(base + SLOT_LINES_OFFSET + s * SLOT_LINES_BYTES)
            self._addrs.append({**slot, **common})
        self.fail = fail if fail is not None else torch.zeros(1, dtype=torch.int32, device=self.device)
        self.state = torch.zeros(handoff.STATE_WORDS, dtype=torch.int64, device=self.device)
        self._deadline_in_state = None
        self.deadline_s = deadline_s                    # (the property writes it into the state)
        self.sync_sequence()
        self._armed = False                             # between arm() and disarm(): the watchdog looks often
        self._taken: dict[str, int] = {}                # counters() at the last take_counters()
        self._lock = threading.Lock()
        self.aborts = 0
        self.abort_reason: str | None = None
        self._closed = False
        self._watchdog = DoorbellWatchdog.shared() if watchdog else None
        if self._watchdog is not None:
            self._watchdog.add(self)

    @property
    def deadline_s(self) -> float:
        return self._deadline_s

    @deadline_s.setter
    def deadline_s(self, value: float) -> None:
        """The watchdog's deadline and the join kernel's own (a device word: captured graphs follow it).
        Set it between steps (a stream-ordered fill when it changes)."""
        self._deadline_s = float(value)
        ns = int(self._deadline_s * 1e9)
        if ns != self._deadline_in_state:
            self.state[handoff.ST_DEADLINE_NS].fill_(ns)
            self._deadline_in_state = ns

    # -- the two kernels ---------------------------------------------------------------------------
    def ring(self, layer: int, x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor, weights: torch.Tensor,
             *, owner: torch.Tensor | None = None, owner_offset: int = 0, split: torch.Tensor | None = None,
             split_slot: int = -1) -> None:
        """Hand layer `layer`'s routes at -1 (those of experts `owner` gives this member) to the worker.
        x [T, H], ids / routes / weights [T, K] on this doorbell's device; owner [L * E] int32 (the member
        of each (layer, expert), layer's row at owner_offset) or None (this member owns every expert);
        split: kernels/expert_split's desc (the routes at split_slot go too, over channels [0, c))."""
        T = x.shape[0]
        if T > self.layout.t_max or ids.numel() > self.layout.max_triples or x.shape[1] != self.layout.hidden:
            raise ValueError(f"{T} tokens x {ids.shape[1] if ids.dim() == 2 else '?'} routes, H={x.shape[1]} do not "
                             f"fit channel {self.client.name!r} (T <= {self.layout.t_max}, T*K <= "
                             f"{self.layout.max_triples}, H = {self.layout.hidden})")
        handoff.ring(x, ids, routes, weights, owner=owner, owner_off=owner_offset, member=self.member,
                     addrs=self._addrs[layer % NUM_SLOTS], fail=self.fail, state=self.state,
                     slot=layer % NUM_SLOTS, layer=layer, hidden_bf16=self.hidden_bf16,
                     always_ring=self.always_ring, split=split, split_slot=split_slot)

    def join(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst = src + the partial sums of layer `layer`'s call (dst = src when nothing was rung or it failed)."""
        handoff.join(src, dst, addrs=self._addrs[layer % NUM_SLOTS], fail=self.fail, state=self.state,
                     slot=layer % NUM_SLOTS)

    # -- after the step ----------------------------------------------------------------------------
    def failure(self) -> int:
        """A failure code the join kernel recorded since `reset` (0: none). Read after the step's
        kernels have finished (a stream sync); host memory, no CUDA call."""
        return int(self._host_fail.value)

    def failure_reason(self) -> str:
        code = self.failure()
        reason = FAIL_REASONS.get(code, f"code {code}") if code else "ok"
        if code == handoff.FAIL_ABORTED and self.abort_reason:
            reason += f" ({self.abort_reason})"
        return reason

    def reset(self) -> None:
        """Clear the failure word, the abort word and the shared device flag (before the step is re-run)."""
        with self._lock:
            self._host_fail.value = 0
            self._abort.value = 0
            self.abort_reason = None
        self.fail.zero_()
        self.sync_sequence()

    def sync_sequence(self) -> None:
        """The ring numbers requests from a device-side copy of the channel's sequence (reading request_seq
        would cost a PCIe round trip per ring). Call this after host-driven calls on the channel
        (CpuPoolClient.submit), with no device call in flight; stream-ordered."""
        last = max(int(self._request_seq.value), int(self._done_seq.value))
        self.state[handoff.ST_SEQ].fill_(last)

    def counters(self) -> dict[str, int]:
        """Cumulative device counters (a device sync): rings, triples, answered, experts, compute_ns, failed,
        wait_ns (the joins' waits for the worker: the global timer's ns; in the interpreter 1000 per spin)."""
        v = self.state.tolist()
        return {"rings": v[handoff.ST_RINGS], "triples": v[handoff.ST_TRIPLES], "answered": v[handoff.ST_ANSWERED],
                "experts": v[handoff.ST_EXPERTS], "compute_ns": v[handoff.ST_COMPUTE_NS],
                "failed": v[handoff.ST_FAILED], "wait_ns": v[handoff.ST_WAIT_NS]}

    def take_counters(self) -> dict[str, int]:
        """What `counters()` grew by since the last take (for a caller that accumulates elsewhere)."""
        now = self.counters()
        taken, self._taken = self._taken, now
        return {k: v - taken.get(k, 0) for k, v in now.items()}

    def reconnect(self, timeout_s: float) -> int:
        """After a fault: wait until a (restarted) worker serves the channel with nothing in flight."""
        pid = self.client.wait_for_worker(timeout_s)
        self.reset()
        return pid

    # -- watchdog (DoorbellWatchdog's interface) -----------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests rung and not answered; at least 1 while armed, so the watchdog keeps looking every
        poll_s during a step (a ring happens on the GPU, where nothing can wake it)."""
        if self._closed:
            return 0
        pending = max(0, int(self._request_seq.value) - int(self._done_seq.value))
        return max(pending, 1) if self._armed else pending

    def arm(self) -> None:
        """Before a step that may ring (HybridExperts.step_begin): clear an abort word left from a request
        that has been answered since (host-driven calls move the same counters), and have the watchdog
        look every poll_s until disarm()."""
        with self._lock:
            if self._abort.value and int(self._done_seq.value) >= int(self._request_seq.value) \
                    and not self._host_fail.value:
                self._abort.value = 0
                self.abort_reason = None
        self._armed = True
        if self._watchdog is not None:
            self._watchdog.kick()

    def disarm(self) -> None:
        self._armed = False

    def kick(self) -> None:
        """Wake the watchdog now (it otherwise looks every 0.1 s while nothing is in flight)."""
        if self._watchdog is not None:
            self._watchdog.kick()

    def watchdog_check(self, now: float, state: dict) -> None:
        """Raise the abort word when the worker of a rung, unanswered request is dead or late."""
        with self._lock:
            if self._closed:
                return
            requested, done = int(self._request_seq.value), int(self._done_seq.value)
            if done >= requested or self._abort.value:
                state.clear()
                return
            waiting_for = done + 1
            if state.get("seq") != waiting_for:
                state["seq"], state["since"] = waiting_for, now
            if not self.client.worker_alive():
                reason, word = "dead", ABORT_DEAD
            elif now - state["since"] >= self.deadline_s:
                reason, word = "timeout", ABORT_LATE
            else:
                return
            self._abort.value = word
            self.abort_reason = reason
            self.aborts += 1
            state.clear()
        log.warning("device doorbell of channel %r: worker %s with requests %d..%d in flight; the GPU stops "
                    "waiting (the step is re-run by fetching)", self.client.name,
                    "died" if reason == "dead" else f"missed the {self.deadline_s * 1e3:.0f} ms deadline",
                    done + 1, requested)
        if self.on_abort is not None:
            try:
                self.on_abort(reason, done + 1, requested)
            except Exception:  # the watchdog must keep running
                log.exception("on_abort callback failed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.remove(self)
        self._words.close()


class DoorbellWatchdog:
    """One daemon thread per process watching every open DeviceDoorbell (`watchdog_check`).

    Sleeps on an event while no doorbell has requests in flight; otherwise looks every `poll_s` (the
    smallest poll_s of the doorbells). Reads host memory and the worker's pidfd only, never a CUDA call,
    so a host thread blocked in CUDA cannot stall it."""

    _shared: "DoorbellWatchdog | None" = None
    _shared_lock = threading.Lock()

    def __init__(self):
        self._doorbells: "weakref.WeakSet[DeviceDoorbell]" = weakref.WeakSet()
        self._states: "weakref.WeakKeyDictionary[DeviceDoorbell, dict]" = weakref.WeakKeyDictionary()
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="doorbell-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> "DoorbellWatchdog":
        with cls._shared_lock:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = cls()
            return cls._shared

    def add(self, doorbell: DeviceDoorbell) -> None:
        with self._lock:
            self._doorbells.add(doorbell)
            self._states[doorbell] = {}
        self.kick()

    def remove(self, doorbell: DeviceDoorbell) -> None:
        with self._lock:
            self._doorbells.discard(doorbell)

    def kick(self) -> None:
        if not self._event.is_set():
            self._event.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                doorbells = [(db, self._states.setdefault(db, {})) for db in self._doorbells]
            busy = [(db, state) for db, state in doorbells if db.in_flight > 0]
            if not busy:
                self._event.clear()
                if not any(db.in_flight > 0 for db, _ in doorbells):     # rung between the look and clear
                    self._event.wait(0.1)
                continue
            now = time.monotonic()
            for db, state in busy:
                try:
                    db.watchdog_check(now, state)
                except Exception:  # pragma: no cover - keep watching the others
                    log.exception("doorbell watchdog check failed")
            time.sleep(min(db.poll_s for db, _ in busy))
