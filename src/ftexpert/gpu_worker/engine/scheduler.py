"""`Scheduler`: which requests run in the next step.

Continuous batching: requests join (admission into a free KV row) and leave (finish, abort) between
steps. Each step runs
- one decode token for every running request whose prompt is fully in the cache, and
- at most one prefill chunk (<= prefill_chunk_tokens) of the oldest running request still prefilling,
so a long prompt never stalls the decoding requests for more than one chunk.
Free KV rows are handed out lowest first, which keeps the rows that decode reads compact.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from ftexpert.gpu_worker.engine.request import Request


@dataclass
class PrefillChunk:
    request: Request
    start_pos: int          # first prompt position of the chunk
    num_tokens: int         # C

    @property
    def is_last(self) -> bool:
        return self.start_pos + self.num_tokens == self.request.num_prompt_tokens


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)
    prefill: PrefillChunk | None = None

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, max_running_requests: int, prefill_chunk_tokens: int):
        if max_running_requests < 1 or prefill_chunk_tokens < 1:
            raise ValueError("max_running_requests and prefill_chunk_tokens must be >= 1")
        self.prefill_chunk_tokens = prefill_chunk_tokens
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
        """Take a request out (finished or aborted) and free its KV row."""
        if request in self.running:
            self.running.remove(request)
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)

    def next_decode_only(self) -> list[Request] | None:
        """The requests the next `plan` will decode, when it will run nothing else (no request to admit, none
        prefilling); None otherwise. No side effects."""
        if (self.waiting and self._free_slots) or any(r.in_prefill for r in self.running):
            return None
        return [r for r in self.running if not r.finished]

    def plan(self) -> StepPlan:
        while self.waiting and self._free_slots:
            req = self.waiting.popleft()
            req.slot = heapq.heappop(self._free_slots)
            self.running.append(req)
        plan = StepPlan(decode=[r for r in self.running if not r.in_prefill and not r.finished])
        for req in self.running:
            if req.in_prefill:
                n = min(self.prefill_chunk_tokens, req.num_prompt_tokens - req.num_prefilled)
                plan.prefill = PrefillChunk(req, req.num_prefilled, n)
                break
        return plan
