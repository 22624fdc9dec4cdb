"""`LinkProbe`: the timings the `auto` prefetch decides from (prefetch_budget.py), taken in the decode steps at no
host sync.

In a timed decode step (one in `TIMED_EVERY`, the same schedule as the copy timer, decode_copy.CopyTimer), per layer L
of a decode-sized call, three CUDA events and one count:
  ready[L]      on the compute stream right after ensure(L) (before it joins L's prefetch copy): from here L's demand
                copy could start;
  demand_end[L] on the copy stream behind L's demand copy (and, in hybrid, behind the split copy);
  fetched_end[L+1] on the copy stream behind the prefetch copy made for L + 1 (= demand_end[L] without one);
  copies[L]     L's demand copies (the plan's length, copied on the device) and the prefetch's installs for L.
They give, per layer: the link's idle window before L, ready[L] - demand_end[L-1]; the join wait at L,
fetched_end[L] - ready[L] (> 0: the compute stream waited for the prefetch); and the link's bandwidth, the bytes
of L's copies over their time on the link, demand_end[L] - max(ready[L], fetched_end[L]) for the demand copy and
fetched_end[L+1] - demand_end[L] for the prefetch's.

The events are `external`, so a decode graph captured with them records them at every replay; there are `SETS`
sets, alternating per timed step (the set, or "untimed", is part of the graph key), and a set is read when it comes
round again (its step ran SETS x TIMED_EVERY steps before) and only if its events have completed (`query`, no
wait). As in CopyTimer, a layer's event counts as recorded from its first record on (eager, or captured into a graph
that then replays); a set whose events are not all of one step (a timed step that skipped a layer) is recognised by
its ready events not rising layer by layer, or by a window longer than the step, and is dropped. The counts of a timed step are copied to pinned host memory behind it (`end_step`) and read with its events.
On a CPU there are no events (nothing runs beside the compute): only `snapshot` tensors are read, every
TIMED_EVERY steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.gpu_worker.backends.offload.decode_copy import CopyTimer


@dataclass
class ProbeSample:
    """What one timed step measured: per layer the idle window and the join wait (None: not measured), the bytes
    copied and the seconds they took on the link, and the snapshot tensors' values at its end."""
    windows: list[float | None]
    joins: list[float | None]
    copy_bytes: float
    copy_s: float
    snapshot: list


class LinkProbe:
    SETS = CopyTimer.SETS
    TIMED_EVERY = CopyTimer.TIMED_EVERY

    def __init__(self, num_layers: int, device: torch.device, expert_bytes: int):
        self.num_layers, self.device, self.expert_bytes = num_layers, device, expert_bytes
        self.on_cuda = device.type == "cuda"
        self.active = 0
        self._steps = 0
        self._in_step = self._timing = False
        if self.on_cuda:
            def events():
                return [[torch.cuda.Event(enable_timing=True, external=True) for _ in range(num_layers)]
                        for _ in range(self.SETS)]
            self._ready, self._demand_end, self._fetched_end = events(), events(), events()
            self._recorded = [[set(), set(), set()] for _ in range(self.SETS)]   # layers each kind recorded
            # [set, (demand copies, prefetch installs), layer], and their host copies
            self._counts = torch.zeros(self.SETS, 2, num_layers, dtype=torch.int64, device=device)
            self._host_counts = torch.zeros(self.SETS, 2, num_layers, dtype=torch.int64, pin_memory=True)
            self._host_snap: list[list[torch.Tensor] | None] = [None] * self.SETS
            self._copied: list[torch.cuda.Event | None] = [None] * self.SETS
            self._pending = [False] * self.SETS

    # -- the step -----------------------------------------------------------------------------------
    def begin_step(self, snapshot: list[torch.Tensor]) -> ProbeSample | None:
        """A decode step starts: timed or not. A timed one takes the next set and returns what that set measured
        SETS timed steps ago (None: nothing complete to read). On a CPU: every TIMED_EVERY steps, the `snapshot`
        tensors' values, no timings."""
        self._steps += 1
        self._timing = self._steps % self.TIMED_EVERY == 1 or self.TIMED_EVERY == 1
        self._in_step = True
        if not self._timing:
            return None
        if not self.on_cuda:
            return ProbeSample([None] * self.num_layers, [None] * self.num_layers, 0.0, 0.0,
                               [t.tolist() for t in snapshot])
        nxt = (self.active + 1) % self.SETS
        sample = self._read(nxt)
        self.active = nxt
        self._pending[nxt] = True
        return sample

    def end_step(self, snapshot: list[torch.Tensor]) -> None:
        """A decode step's work is queued: in a timed step (CUDA), its counts and the `snapshot` tensors are copied
        to pinned host memory behind it."""
        if self.on_cuda and self._in_step and self._timing:
            s = self.active
            self._host_counts[s].copy_(self._counts[s], non_blocking=True)
            if self._host_snap[s] is None:
                self._host_snap[s] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in snapshot]
            for host, t in zip(self._host_snap[s], snapshot):
                host.copy_(t, non_blocking=True)
            self._copied[s] = torch.cuda.Event()
            self._copied[s].record()
        self._in_step = False

    def graph_key(self) -> int:
        """The event set a decode step captured now records, -1 for an untimed one (CopyTimer.graph_key's)."""
        return (self.active if self._timing else -1) if self.on_cuda else 0

    # -- the records (decode-sized layer calls of a timed step; nothing otherwise) ---------------------
    def timing(self, layer: int) -> bool:
        """Whether a decode-sized call of `layer` now takes the marks (CUDA, a timed decode step)."""
        return self.on_cuda and self._in_step and self._timing and 0 <= layer < self.num_layers

    def _record(self, kind: int, layer: int, stream) -> None:
        events = (self._ready, self._demand_end, self._fetched_end)[kind]
        events[self.active][layer].record(stream)
        self._recorded[self.active][kind].add(layer)

    def ready(self, layer: int, stream, demand_copies: torch.Tensor) -> None:
        """Right after ensure(layer), on the compute stream: the event, and the plan's length `demand_copies` [1]."""
        if self.timing(layer):
            self._record(0, layer, stream)
            self._counts[self.active, 0, layer].copy_(demand_copies.reshape(()))

    def demand_end(self, layer: int, stream) -> None:
        """On the copy stream, behind layer's demand copy."""
        if self.timing(layer):
            self._record(1, layer, stream)

    def fetched_end(self, target: int, stream, installed: torch.Tensor | None) -> None:
        """On the copy stream, behind the prefetch copy made for `target` (or where it would be); `installed` [1]:
        its length (None: none)."""
        if self.timing(target):
            self._record(2, target, stream)
            if installed is not None:
                self._counts[self.active, 1, target].copy_(installed.reshape(()))
            else:
                self._counts[self.active, 1, target].zero_()

    # -- reading a set --------------------------------------------------------------------------------
    def _read(self, s: int) -> ProbeSample | None:
        if not self._pending[s]:
            return None
        self._pending[s] = False
        copied = self._copied[s]
        if copied is None or not copied.query():
            return None
        snap = [t.tolist() for t in self._host_snap[s]] if self._host_snap[s] is not None else []
        none = [None] * self.num_layers
        empty = ProbeSample(list(none), list(none), 0.0, 0.0, snap)
        if not self._complete(s):
            return empty
        counts = self._host_counts[s].tolist()
        ready, dend, fend = self._ready[s], self._demand_end[s], self._fetched_end[s]
        rec_ready, rec_dend, rec_fend = self._recorded[s]
        layers = sorted(rec_ready)
        rises = [_elapsed(ready[a], ready[b]) for a, b in zip(layers, layers[1:])]
        if not rises or any(t is None or t < 0 for t in rises):
            return empty                  # events of different steps
        span = sum(rises)                 # the step, from the first layer's ensure to the last's

        def within(t: float | None) -> float | None:
            return t if t is not None and abs(t) <= span else None

        windows, joins = list(none), list(none)
        nbytes = seconds = 0.0
        for layer in layers:
            if layer - 1 in rec_dend:
                windows[layer] = within(_elapsed(dend[layer - 1], ready[layer]))
            if layer in rec_fend:
                joins[layer] = within(_elapsed(ready[layer], fend[layer]))
            if layer not in rec_dend:
                continue
            # the demand copy starts once the compute stream forks it and the link is free
            start = fend[layer] if (joins[layer] or 0.0) > 0 else ready[layer]
            t = within(_elapsed(start, dend[layer]))
            if t is not None and t > 0 and counts[0][layer] > 0:
                nbytes += counts[0][layer] * self.expert_bytes
                seconds += t
            if layer + 1 in rec_fend and counts[1][layer + 1] > 0:
                t = within(_elapsed(dend[layer], fend[layer + 1]))
                if t is not None and t > 0:
                    nbytes += counts[1][layer + 1] * self.expert_bytes
                    seconds += t
        return ProbeSample(windows, joins, nbytes, seconds, snap)

    def _complete(self, s: int) -> bool:
        """Every event the set recorded has completed (no wait)."""
        for events, layers in zip((self._ready[s], self._demand_end[s], self._fetched_end[s]), self._recorded[s]):
            for layer in layers:
                if not events[layer].query():
                    return False
        return True


def _elapsed(start: torch.cuda.Event, end: torch.cuda.Event) -> float | None:
    """Seconds from `start` to `end` (negative when `end` came first); None when either never recorded a time."""
    try:
        return start.elapsed_time(end) / 1e3
    except RuntimeError:
        return None
