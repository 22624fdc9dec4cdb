"""`Scheduler`: which requests run in the next step, and their KV blocks.

Continuous batching: requests join (admission) and leave (finish, abort, preemption) between steps. Each step runs
- one decode token for every running request whose prefill is done, and
- at most one prefill chunk (<= prefill_chunk_tokens) of the oldest running request still prefilling,
so a long prompt never stalls the decoding requests for more than one chunk.

Blocks (kv_blocks.py), planned oldest request first:
1. growth: each decoding request gets the blocks of its next positions. When the pool has too few, the youngest
   running request is preempted: its blocks go back (its full ones stay in the prefix cache), and it waits at the
   head of the queue with its output kept, to recompute its K/V when it runs again. So a request that fits in the
   pool alone (checked at add_request) is never failed for want of blocks.
2. admission (not in a step that preempted): the request at the head of the queue (first come, first served),
   when a slot (block table row, state cache row; max_running_requests of them) is free and the available blocks
   cover its prefill, less what the prefix cache shares, with one block to spare per running request (so that
   it is not preempted again at once). Free slots are handed out lowest first.
A KV cache with a window group (the sliding-window layers: kv_cache.py, window_blocks.py) gives each request's window
its blocks in `grow` too, and releases those before the window, and the request whose prefill chunk runs its chunk's
blocks; that pool holds every running request's bound, so it takes no part in preemption, and admission checks it
too.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from ftexpert.gpu_worker.engine.kv_blocks import Admission, KVBlocks
from ftexpert.gpu_worker.engine.request import Request


@dataclass
class PrefillChunk:
    request: Request
    start_pos: int          # first position of the chunk
    num_tokens: int         # C

    @property
    def ends_prefill(self) -> bool:
        return self.start_pos + self.num_tokens == self.request.prefill_len

    @property
    def is_last(self) -> bool:
        """The last chunk of a request's prompt: its last token's logits give the first token. (The chunk that ends a
        preempted request's recompute, which has its output already, samples nothing.)"""
        return self.ends_prefill and not self.request.output_ids


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)
    prefill: PrefillChunk | None = None

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, max_running_requests: int, prefill_chunk_tokens: int, kv: KVBlocks):
        if max_running_requests < 1 or prefill_chunk_tokens < 1:
            raise ValueError("max_running_requests and prefill_chunk_tokens must be >= 1")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []           # admission order
        self._free_slots = list(range(max_running_requests))
        heapq.heapify(self._free_slots)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: Hashable) -> Request | None:
        for req in self.running:
            if req.request_id == request_id:
                return req
        for req in self.waiting:
            if req.request_id == request_id:
                return req
        return None

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and free its slot and blocks."""
        if request in self.running:
            self._vacate(request)
            self.running.remove(request)
            self.kv.publish()
        elif request in self.waiting:
            self.waiting.remove(request)

    def _vacate(self, request: Request) -> None:
        self.kv.free(request)
        heapq.heappush(self._free_slots, request.slot)
        request.slot = None

    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks and slot back; it waits first in line to recompute them."""
        self._vacate(request)
        self.running.remove(request)
        request.restart()
        self.waiting.appendleft(request)
        self.kv.stats.kv_preemptions_total += 1

    def _growth(self) -> int:
        return sum(self.kv.growth(r) for r in self.running)

    def _admissible(self, req: Request, available: int) -> tuple[Admission, bool]:
        """(what admitting it takes, whether the head of the queue would be admitted with `available` blocks of the
        full-context group; the window group, where there is one, must have its blocks too)."""
        adm = self.kv.admission(req)
        return adm, adm.cost + len(self.running) <= available and self.kv.window_fits(adm)

    def next_decode_only(self) -> list[Request] | None:
        """The requests the next `plan` will decode, when it will run nothing else (no request to admit or
        preempt, none prefilling); None otherwise (or where that cannot be told for sure). No side effects."""
        if any(r.in_prefill for r in self.running):
            return None
        left = self.kv.pool.num_available - self._growth()
        if left < 0:
            return None                                  # the plan preempts
        if self.waiting and self._free_slots and self._admissible(self.waiting[0], left)[1]:
            return None
        return [r for r in self.running if not r.finished]

    def plan(self) -> StepPlan:
        for req in self.running:                        # K/V the last step completed: into the prefix cache
            self.kv.register_full(req)
        preempted = False
        for req in list(self.running):                  # oldest first
            if req not in self.running:
                continue                                # preempted for an older one
            while self.kv.growth(req) > self.kv.pool.num_available:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self.kv.grow(req)
        while not preempted and self.waiting and self._free_slots:
            req = self.waiting[0]
            adm, ok = self._admissible(req, self.kv.pool.num_available)
            if not ok:
                break
            self.waiting.popleft()
            req.slot = heapq.heappop(self._free_slots)
            self.kv.admit(req, req.slot, adm)
            self.running.append(req)
        plan = StepPlan(decode=[r for r in self.running if not r.in_prefill and not r.finished])
        for req in plan.decode:         # a decode step writes position seq_len - 1: never through a -1 entry
            if len(req.blocks) * self.kv.block_size < req.seq_len:
                raise RuntimeError(f"request {req.request_id!r} decodes position {req.seq_len - 1} with "
                                   f"{len(req.blocks)} KV blocks of {self.kv.block_size}")
        for req in self.running:
            if req.in_prefill:
                n = min(self.prefill_chunk_tokens, req.prefill_len - req.num_prefilled)
                plan.prefill = PrefillChunk(req, req.num_prefilled, n)
                self.kv.prefill(req, n)                 # the window group's blocks of the chunk
                break
        self.kv.kv.sync()                               # the block tables to the device, behind queued steps
        self.kv.publish()
        return plan
