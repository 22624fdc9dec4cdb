"""`auto`'s guard (docs/PREFETCH.md "The guard"): the prefetch kept only where it makes decode steps faster, as
measured, not as the budget rule (prefetch_budget.py) expects.

The rule sizes each layer's installs from the link's idle window, the copy time and the predictor's precision. Its
model leaves out costs it cannot see from the link: the predictor's and the install's kernels on the compute
stream, the copy kernel's SMs taken from the GEMMs it overlaps, and the part of a demand copy that the hits' GEMMs
hide anyway (so a right guess saves less than a whole copy). Where those outweigh the saved copies (H100, nvfp4,
50% cache: the rule expected 1.2 ms a step, the row lost 2.2%), only the step time says so.

So, while the rule would predict, the guard runs decode steps in blocks of `block` steps, each block with the
predictor on or off (an off block runs as `off`: no predictor, no installs), and times each step's forward on the
GPU (CUDA events around it, read when complete: no host sync). A block's figure is the median of its steps, less
the first `settle` (the step after a switch). It compares each block with the block before it when their modes
differ: the ratio on / off of their medians. First it alternates modes until it has `explore` ratios; then it runs
the winner (on while the median of its last `window` ratios is below 1 - `margin`) and one block in `check_every` in
the other mode, whose ratio against the block before it keeps the decision current as the cache warms, the batch
changes or the context grows. What it costs: the exploration's blocks (once a backend: a policy switch away from
`auto` and back keeps the decision, `pause`), then one block in `check_every` in the losing mode (1/16 of the gain,
or of the loss).

`StepGuard` is pure Python (tests/gpu_worker/test_prefetch_guard.py: a table of outcomes on step times);
`StepTimer` holds the events.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class StepGuard:
    """Which decode steps predict, from the measured step times (module docstring). Per step while the rule would
    predict: `next_on()` (this step's mode), later `observe(block, index, on, seconds)` with the values `next_on`
    gave in `last` (a step's time may arrive steps later; the order of arrival is the order of the steps)."""
    block: int = 8
    settle: int = 1
    explore: int = 4
    window: int = 8
    check_every: int = 16
    margin: float = 0.005
    ratios: deque = field(init=False)
    decided_on: bool | None = field(init=False, default=None)   # None while exploring
    last: tuple[int, int, bool] = field(init=False, default=(-1, -1, False))   # (block, index, on) of next_on()
    _step: int = field(init=False, default=0)
    _modes: dict = field(init=False)            # block -> its mode, for the blocks not yet closed
    _times: list = field(init=False)            # the open block's step times (after `settle`)
    _open: int = field(init=False, default=-1)  # the block whose times are being gathered
    _prev: tuple[bool, float] | None = field(init=False, default=None)   # the last closed block: (on, median)

    def __post_init__(self) -> None:
        if self.block < 2 or not 0 <= self.settle < self.block:
            raise ValueError(f"StepGuard block {self.block} / settle {self.settle}: need block >= 2, "
                             "0 <= settle < block")
        self.ratios = deque(maxlen=self.window)
        self._modes, self._times = {}, []

    # -- the schedule ------------------------------------------------------------------------------------
    def _block_on(self, b: int) -> bool:
        """The mode of block b, decided when its first step is scheduled."""
        if b not in self._modes:
            if self.decided_on is None:                       # exploring: on, off, on, off, ...
                on = b % 2 == 0
            else:
                check = b % self.check_every == self.check_every - 1
                on = self.decided_on != check
            self._modes[b] = on
        return self._modes[b]

    def next_on(self) -> bool:
        """The mode of the next decode step (True: the predictor runs); its (block, index, on) in `last`."""
        b, i = divmod(self._step, self.block)
        self._step += 1
        on = self._block_on(b)
        self.last = (b, i, on)
        return on

    # -- the measurements --------------------------------------------------------------------------------
    def observe(self, b: int, i: int, on: bool, seconds: float) -> None:
        """A scheduled step's forward took `seconds` on the GPU."""
        if b != self._open:
            self._close()
            self._open, self._times = b, []
        if i >= self.settle and seconds > 0.0:
            self._times.append((on, seconds))
        if i == self.block - 1:
            self._close()

    def _close(self) -> None:
        """The open block is complete: its median against the block before it, when their modes differ."""
        if self._open < 0:
            return
        b, times = self._open, self._times
        self._open, self._times = -1, []
        self._modes.pop(b, None)
        for old in [k for k in self._modes if k < b]:
            del self._modes[old]
        if not times:
            return
        on = times[0][0]
        med = statistics.median(s for _, s in times)
        if self._prev is not None and self._prev[0] != on:
            on_s, off_s = (med, self._prev[1]) if on else (self._prev[1], med)
            self.ratios.append(on_s / off_s)
            if len(self.ratios) >= self.explore:
                ratio = statistics.median(self.ratios)
                decided = ratio < 1.0 - self.margin
                if decided != self.decided_on:
                    log.info("prefetch auto: the predictor %s (decode steps with it / without: %.3f, the median of "
                             "%d block pairs)", "runs" if decided else "stops", ratio, len(self.ratios))
                self.decided_on = decided
        self._prev = (on, med)

    def pause(self) -> None:
        """The mode leaves `auto` (SetPolicy): the open block and the block before it are dropped (the steps that
        resume are not compared with steps before the pause), the decision and its ratios are kept. A backend that
        comes back to `auto` runs its winner at once, the check blocks keeping the decision current, instead of
        exploring again: the exploration is paid once a backend."""
        self._modes.clear()
        self._times, self._open, self._prev = [], -1, None

    def report(self) -> dict:
        """The guard's state: its decision (None while exploring), the median ratio on / off, how many it holds."""
        return {"decided_on": self.decided_on, "ratio": statistics.median(self.ratios) if self.ratios else None,
                "ratios": len(self.ratios)}


class StepTimer:
    """The GPU time of each timed decode step's forward: a CUDA event pair around it on the compute stream, read
    when the end event has completed (`query`, no wait); on a CPU the forward's host time (it runs in program
    order). `begin(tag)` before the forward, `end()` after it (a step that raised never ends: the next `begin`
    replaces it); `poll()` gives the (tag, seconds) of the finished steps in order."""
    RING = 64

    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                            for _ in range(self.RING)]
        self._next = 0
        self._pending: deque = deque()          # (ring index or host seconds, tag), oldest first
        self._open: tuple | None = None

    def begin(self, tag) -> None:
        if self.on_cuda:
            if len(self._pending) >= self.RING - 1:      # a full ring: the oldest pair is reused unread
                self._pending.popleft()
            idx = self._next
            self._next = (self._next + 1) % self.RING
            self._events[idx][0].record()
            self._open = (idx, tag)
        else:
            self._open = (time.perf_counter(), tag)

    def end(self) -> None:
        if self._open is None:
            return
        ref, tag = self._open
        self._open = None
        if self.on_cuda:
            self._events[ref][1].record()
            self._pending.append((ref, tag))
        else:
            self._pending.append((time.perf_counter() - ref, tag))

    def clear(self) -> None:
        """Forget every step not yet read (a new policy: their tags belong to a guard that is gone)."""
        self._pending.clear()
        self._open = None

    def poll(self) -> list[tuple[object, float]]:
        out = []
        while self._pending:
            ref, tag = self._pending[0]
            if self.on_cuda:
                start, end = self._events[ref]
                if not end.query():
                    break
                seconds = start.elapsed_time(end) / 1e3
            else:
                seconds = ref
            self._pending.popleft()
            out.append((tag, seconds))
        return out
