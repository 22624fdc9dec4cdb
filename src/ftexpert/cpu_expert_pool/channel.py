"""The CPU worker's end of the hot-path channel (layout and state machine: proto/shm_layout.py).

``WorkerChannel`` polls for requests, publishes results and heartbeats (the GPU worker's end,
``CpuPoolClient``, is in proto/cpu_channel.py); ``IdleWaiter`` is the worker's waiting policy (spin
while hot, then short growing sleeps). No sockets and no pickling here: plain loads and stores on
shared memory.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from ftexpert.proto.cpu_channel import ChannelEnd
from ftexpert.proto.shm_layout import WORKER_SERVING, WORKER_STARTING, WORKER_STOPPED, ChannelViews
from ftexpert.proto.shm_segment import process_start_ticks

NS_PER_S = 1_000_000_000


class ChannelBusy(RuntimeError):
    """Another live worker already serves this channel."""


@dataclasses.dataclass
class Request:
    seq: int
    slot: int
    layer: int
    num_tokens: int
    num_triples: int
    hidden: torch.Tensor       # [T, H] view
    token_idx: torch.Tensor    # [n] int32 view
    expert_id: torch.Tensor    # [n] int32 view
    weight: torch.Tensor       # [n] fp32 view
    out: torch.Tensor          # [T, H] fp32 view
    malformed: bool = False    # counts outside the layout: answer STATUS_BAD_REQUEST without computing
    split_expert: int = -1     # with split_limit > 0: this expert over channels [0, split_limit) only
    split_limit: int = 0       # 0: no split (the worker checks the rest against the store: a bad split is
                               # answered STATUS_BAD_REQUEST)


class WorkerChannel(ChannelEnd):
    """The CPU worker's end: one process at a time serves a channel."""

    def __init__(self, channel_name: str):
        super().__init__(channel_name)
        self._done = 0
        self.epoch = 0          # 0 until start() claims the channel

    def start(self) -> int:
        """Claim the channel: drop what a dead predecessor left in flight; returns the new epoch."""
        w = self._words
        pid = w.worker_pid[0]
        if w.worker_state[0] in (WORKER_STARTING, WORKER_SERVING) and pid != os.getpid() \
                and process_start_ticks(pid) is not None:
            raise ChannelBusy(f"channel {self.name!r} is served by live process {pid}; stop that worker first "
                              "(one worker per channel)")
        w.worker_state[0] = WORKER_STARTING
        w.worker_pid[0] = os.getpid()
        self.epoch = int(w.worker_epoch[0]) + 1
        w.worker_epoch[0] = self.epoch
        self._done = int(w.request_seq[0])
        w.done_seq[0] = self._done
        self.beat()
        return self.epoch

    def serve(self) -> None:
        self.beat()
        self._words.worker_state[0] = WORKER_SERVING

    def stop(self) -> None:
        if self.epoch and self._words.worker_pid[0] == os.getpid():
            self._words.worker_state[0] = WORKER_STOPPED

    def beat(self, now_ns: int | None = None) -> None:
        self._words.heartbeat_ns[0] = time.monotonic_ns() if now_ns is None else now_ns

    def has_request(self) -> bool:
        return self._words.request_seq[0] > self._done

    @property
    def done(self) -> int:
        """The last request answered (this end's copy of done_seq)."""
        return self._done

    @done.setter
    def done(self, seq: int) -> None:
        """After requests were answered elsewhere on this end's behalf (the C loop, native_loop.py)."""
        self._done = int(seq)

    @property
    def views(self) -> ChannelViews:
        """numpy views of the mapped channel (their addresses stay valid until close())."""
        return self._views

    def next_request(self) -> Request | None:
        """The next request in order, or None. A request whose slot is missing is answered at once."""
        if self._words.request_seq[0] <= self._done:
            return None
        seq = self._done + 1
        for s, lines in enumerate(self._lines):
            if lines.req_seq[0] == seq:
                t, n = lines.req_tokens[0], lines.req_triples[0]
                if not (0 <= t <= self.layout.t_max and 0 <= n <= self.layout.max_triples):
                    t, n = 0, 0                       # answered as a bad request by the worker
                    bad = True
                else:
                    bad = False
                hidden, out = self._slots[s].token_views(t)
                return Request(seq, s, lines.req_layer[0], t, n, hidden, *self._slots[s].triple_views(n), out,
                               malformed=bad, split_expert=lines.req_split_expert[0],
                               split_limit=lines.req_split_limit[0])
        self._done = seq                     # request_seq rang without a slot: answer so nobody hangs
        self._words.done_seq[0] = seq
        return None

    def complete(self, request: Request, status: int, *, num_experts: int = 0, compute_ns: int = 0) -> None:
        lines = self._lines[request.slot]
        lines.resp_status[0] = status
        lines.resp_experts[0] = num_experts
        lines.resp_compute_ns[0] = compute_ns
        lines.resp_seq[0] = request.seq          # the response line is complete ...
        self._done = request.seq
        self._words.done_seq[0] = request.seq    # ... before done_seq moves

    def close(self) -> None:
        del self._slots, self._lines, self._views, self._words
        self._seg.close()


@dataclasses.dataclass
class IdlePolicy:
    hot_s: float = 0.050          # after a request, spin continuously this long
    spin_s: float = 50e-6         # when cold, spin this long between sleeps
    sleep_min_s: float = 20e-6    # cold sleeps grow from this ...
    sleep_max_s: float = 1e-3     # ... doubling up to this (the worst added latency of a cold request)


class IdleWaiter:
    """The worker's waiting policy between requests; call ``pause`` on every idle turn of the loop."""

    def __init__(self, policy: IdlePolicy):
        self.policy = policy
        self._last_work_ns = time.monotonic_ns()
        self._spin_until_ns = 0
        self._sleep_s = policy.sleep_min_s

    @property
    def last_work_ns(self) -> int:
        return self._last_work_ns

    def worked(self, now_ns: int) -> None:
        self._last_work_ns = now_ns
        self._sleep_s = self.policy.sleep_min_s

    def pause(self, now_ns: int) -> None:
        if now_ns - self._last_work_ns < self.policy.hot_s * NS_PER_S:
            return                                            # hot: pure spin
        if self._spin_until_ns == 0:
            self._spin_until_ns = now_ns + int(self.policy.spin_s * NS_PER_S)
        if now_ns < self._spin_until_ns:
            return                                            # cold, spinning between sleeps
        time.sleep(self._sleep_s)
        self._sleep_s = min(2 * self._sleep_s, self.policy.sleep_max_s)
        self._spin_until_ns = 0
