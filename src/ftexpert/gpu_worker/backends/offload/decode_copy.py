"""`DecodeCopy`: a decode-sized layer call's missing experts copied by the device copy kernel (kernels/expert_copy)
beside the GEMMs of its hits, graph-capturable; `CopyTimer`: the time those copies take.

`DecodeCopy` is built once per backend (the pool, the host rows, the cache, the copy stream, the timer); `run`
takes what varies per layer call. After the last `ensure` of the call (its plan on the device, routes rewritten to
slot ids): on CUDA, in the gemv mode, the copy runs on the copy stream while moe_gemv computes the routes whose
slot the plan does not fill (the hits), then the compute stream waits for the copy and moe_gemv computes the
fetched routes (`kernels.moe_decode.CopyPlan`). With `split` the copy goes in two parts, every planned expert's
w13 and then every one's w2 (`copy_plan(cols=...)`): the fetched routes' gate/up waits for the first part only and
runs while the w2 rows are still crossing the link, so after the last byte lands only their down and the sum are
left. Bit-identical to the serial order (copy, then every GEMM on one stream: the CPU, or another mode) either way;
graph-capturable (the copy stream forks from and joins the capturing stream). The GEMMs go through the pool's
`ExpertRows` (gpu_worker/backends/expert_math.py), so any expert format works; a quantized row keeps gate/up's
scales after w2's codes, so its copy is one part (`ExpertRows.w13_bytes` is 0).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ftexpert.gpu_worker.backends.expert_math import ExpertRows
from ftexpert.kernels.expert_copy import copy_plan
from ftexpert.kernels.moe_decode import CopyPlan
from ftexpert.kernels.slot_cache import SlotCache


class CopyTimer:
    """Seconds spent on expert copies. The CPU: host time around each copy. CUDA: a pair of timing events around
    each copy, on the stream it runs on. Decode steps (`begin_step` .. `end_step`) are timed one in `TIMED_EVERY`
    (the first, then every TIMED_EVERY-th): the per-layer timing events of a CUDA graph are nodes of its own, and in
    every step they cost the 50% offload decode ~5% of its tok/s on the H200; the decode copy time reported is the
    timed steps' measured time scaled by the steps they stand for. In a timed step a layer's pair is a fixed one of
    the current event set, created `external` so that a decode graph captured with it records it at every replay;
    the sets alternate per timed step (the set, or "untimed", is part of the graph key), and a set is read when it
    comes round again (its step ran SETS x TIMED_EVERY steps before: the engine has read that step's tokens by then) or at
    `resolve`. Outside a step (prefill chunks, the DMA copies) each copy gets a fresh pair, every one timed."""

    SETS = 2
    TIMED_EVERY = 16

    def __init__(self, num_layers: int, on_cuda: bool):
        self.on_cuda, self.active = on_cuda, 0
        self.total_s = 0.0                          # host-timed copies and loose pairs: every copy
        self._step_s = 0.0                          # the timed decode steps' copies
        self._steps = self._timed_steps = 0
        self._in_step = self._timing = False
        self._loose: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []      # pairs outside a step
        if on_cuda:
            def pair():
                return (torch.cuda.Event(enable_timing=True, external=True),
                        torch.cuda.Event(enable_timing=True, external=True))
            self._sets = [[pair() for _ in range(num_layers)] for _ in range(self.SETS)]
            self._recorded: list[set[int]] = [set() for _ in range(self.SETS)]   # layers whose pair a set recorded
            self._pending = [False] * self.SETS         # the set holds a step whose time is not added yet

    def begin_step(self) -> None:
        """A decode step starts: timed or not; a timed one takes the next set, after adding the step it held."""
        self._steps += 1
        self._timing = self._steps % self.TIMED_EVERY == 1 or self.TIMED_EVERY == 1
        if self.on_cuda and self._timing:
            self._timed_steps += 1
            nxt = (self.active + 1) % self.SETS
            self._resolve_set(nxt)
            self.active, self._pending[nxt] = nxt, True
        self._in_step = True

    def end_step(self) -> None:
        self._in_step = False

    def events(self, layer_idx: int) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """CUDA: the (start, end) pair to record around layer `layer_idx`'s copy; None in an untimed decode step."""
        if self._in_step and 0 <= layer_idx < len(self._sets[self.active]):
            if not self._timing:
                return None
            if not torch.cuda.is_current_stream_capturing():
                # an eager record (the engine's warm-ups run before each capture): from now on the pair holds a
                # time; a capture alone records nothing until its graph replays
                self._recorded[self.active].add(layer_idx)
            return self._sets[self.active][layer_idx]
        return self.loose_pair()

    def loose_pair(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """A fresh (start, end) pair, added up at the next `resolve`."""
        pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._loose.append(pair)
        return pair

    def add_host(self, seconds: float) -> None:
        self.total_s += seconds

    def _resolve_set(self, s: int) -> None:
        if not self._pending[s]:
            return
        self._pending[s] = False
        for layer in self._recorded[s]:
            start, end = self._sets[s][layer]
            end.synchronize()
            self._step_s += start.elapsed_time(end) / 1e3

    def resolve(self) -> float:
        """The total so far (waits for the copies recorded): every copy outside decode steps, and the timed decode
        steps' copies scaled to all decode steps."""
        if self.on_cuda:
            for s in range(self.SETS):
                self._resolve_set(s)
            if self._in_step and self._timing:    # the current step's copies may not all be queued yet
                self._pending[self.active] = True
        for start, end in self._loose:
            end.synchronize()
            self.total_s += start.elapsed_time(end) / 1e3
        self._loose.clear()
        scale = self._steps / self._timed_steps if self._timed_steps else 0.0
        return self.total_s + self._step_s * scale

    def graph_key(self) -> int:
        """The event set a decode step captured now records, -1 for an untimed step (its graph records none)."""
        return (self.active if self._timing else -1) if self.on_cuda else 0


@dataclass
class DecodeCopy:
    """The decode copy of one backend's pool (see the module docstring): `run` per layer call."""
    slots: torch.Tensor                         # [S_total, N] the GPU pool (packed rows, expert_layout)
    host_layers: Sequence[torch.Tensor]         # [E, N] host rows per layer (mapped for the device on CUDA)
    cache: SlotCache
    rows: ExpertRows                            # the expert math over `slots` (expert_math.expert_rows)
    stream: "torch.cuda.Stream | None" = None   # the copy stream (CUDA); None: copy, then the GEMMs, on one stream
    split: bool = True                          # the copy in two parts, w13 then w2 (with `stream`)
    timer: CopyTimer | None = None
    extra_stream: "torch.cuda.Stream | None" = None    # the stream of `run(extra_copy=...)`'s copy (with `stream`)
    kernel_impl: str = "auto"                   # moe_gemv: Triton on CUDA, reference on CPU ("triton": tests)
    w13_cols: int = field(init=False)           # elements of w13 at the start of a row (0: no two-part copy)

    def __post_init__(self) -> None:
        if self.rows.rows.data_ptr() != self.slots.data_ptr():
            raise ValueError("DecodeCopy: rows must compute over the pool `slots` it copies into")
        self.w13_cols = self.rows.w13_bytes // self.slots.element_size() if self.split else 0

    def run(self, layer_idx: int, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, *, mode: str,
            max_copies: int | None = None, after_fork: "Callable[[], None] | None" = None,
            extra_copy: "Callable[[int], None] | None" = None, extra_slot: int = -1) -> torch.Tensor:
        """The copy of the last `ensure`'s plan for layer `layer_idx`, then the expert FFN over `slot_ids` (routes
        at -1 add 0 in the gemv mode). `max_copies`: an upper bound of the plan's length (default: the routes, at
        most the pool). `after_fork` (the counters, the CPU hand-off's rings, the lookahead's install of the next layer)
        runs on the compute stream right after the copy is launched, beside it; serially, before the copy. It must not
        read or write the slots, nor write this copy's plan (evict_slots, src_indices, num_indices), the routes or x
        (the install writes the slot maps and the prefetch plan, which the copy does not read). If anything raises after the fork, the copy streams are joined and the error
        re-raised; serially it raises before the copy, and the layer's slots that `ensure` just mapped are left
        unfilled (the backend's `forget_slots_after_error` empties the cache). `extra_copy(part)` (the hybrid
        backend's split expert, kernels/expert_split) fills pool row `extra_slot`: part 0 (w13), then part 1 (w2),
        on `extra_stream` forked beside the plan copy (so the two share the link instead of queueing), else after
        the plan's parts; the routes at `extra_slot` wait for it as the fetched ones wait for the plan."""
        c = self.cache
        if max_copies is None:
            max_copies = min(slot_ids.numel(), c.num_slots)
        host_layer = self.host_layers[layer_idx]
        side, extra_stream = self.stream, self.extra_stream
        own_stream = extra_copy is not None and extra_stream is not None and side is not None

        def copy(cols: tuple[int, int] | None = None) -> None:
            copy_plan(self.slots, host_layer, c.evict_slots, c.src_indices, c.num_indices, max_copies=max_copies,
                      cols=cols)
            if extra_copy is not None and not own_stream:
                for part in ((0, 1) if cols is None else (0,) if cols[0] == 0 else (1,)):
                    extra_copy(part)

        if side is None or mode != "gemv":
            if after_fork is not None:
                after_fork()
            self._timed(layer_idx, copy, None if side is None else torch.cuda.current_stream(x.device))
            if own_stream:
                extra_copy(0)
                extra_copy(1)
            return self.rows.ffn(mode, x, slot_ids, weights, kernel_impl=self.kernel_impl)
        compute = torch.cuda.current_stream(x.device)
        w13_cols, extra_w13, w13_landed = self.w13_cols, None, None

        def all_landed() -> None:
            compute.wait_stream(side)
            if own_stream:
                compute.wait_stream(extra_stream)

        def w13_in() -> None:
            compute.wait_event(w13_landed)
            if extra_w13 is not None:
                compute.wait_event(extra_w13)

        def parts() -> None:
            nonlocal w13_landed
            if w13_cols:
                copy((0, w13_cols))
                w13_landed = torch.cuda.Event()
                w13_landed.record(side)
                copy((w13_cols, self.slots.shape[1]))
            else:
                copy()

        side.wait_stream(compute)               # ensure (and every GEMM reading the old slots) first
        if own_stream:
            extra_stream.wait_stream(compute)
        try:                                    # from the fork on: whatever raises, the side streams join
            if own_stream:
                with torch.cuda.stream(extra_stream):
                    extra_copy(0)
                    if w13_cols:
                        extra_w13 = torch.cuda.Event()
                        extra_w13.record(extra_stream)
                    extra_copy(1)
            with torch.cuda.stream(side):
                self._timed(layer_idx, parts, side)
            if after_fork is not None:
                after_fork()
            return self.rows.ffn("gemv", x, slot_ids, weights, kernel_impl=self.kernel_impl,
                                 plan=CopyPlan(c.evict_slots, c.num_indices, max_copies, extra_slot=extra_slot),
                                 between=w13_in if w13_cols else all_landed,
                                 between_down=all_landed if w13_cols else None)
        except BaseException:                   # raised, perhaps before the wait: join anyway, so nothing
            all_landed()                        # later runs beside the copy (and a capture can end)
            raise

    def _timed(self, layer_idx: int, copy: Callable[[], None], stream: "torch.cuda.Stream | None") -> None:
        """`copy()`, timed by `timer` if there is one: events on `stream` (CUDA), else the host's clock."""
        timer = self.timer
        if timer is None:
            copy()
        elif stream is None:
            t0 = time.perf_counter()
            copy()
            timer.add_host(time.perf_counter() - t0)
        else:
            pair = timer.events(layer_idx)
            if pair is None:                    # an untimed decode step
                copy()
                return
            pair[0].record(stream)
            copy()
            pair[1].record(stream)
