"""The client half of the hot-path channel (layout and state machine: proto/shm_layout.py).

``CpuPoolClient`` is the GPU worker's end of one CPU worker's channel (submit a layer's CPU share,
optionally with one split expert computed over a prefix of its channels, wait for its partial sums);
its errors (``WorkerDead``, ``WorkerTimeout``, ``WorkerError``) say what the caller falls back on.
``ChannelEnd`` maps what both ends share; the worker's end (``WorkerChannel``) is in
cpu_expert_pool/channel.py. The owner's (the coordinator's) calls, torch-free, are in proto/shm_layout.py
(``create_worker_channel``, ``channel_name_for``, ``channel_hidden_dtype``).
No sockets and no pickling here: plain loads and stores on shared memory.
"""
from __future__ import annotations

import dataclasses
import os
import select
import time
from typing import Sequence

import numpy as np
import torch

from ftexpert.proto.shm_layout import (DONE_SEQ_OFFSET, HEARTBEAT_NS_OFFSET, NUM_SLOTS, REQUEST_SEQ_OFFSET, SPLIT_CHANNEL_UNIT,
                              STATUS_NAMES, STATUS_OK, STATUS_PROTOCOL_ERROR, WORKER_SERVING, WORKER_STATE_NAMES,
                              WORKER_STOPPED, ChannelViews, attach_channel)
from ftexpert.proto.shm_segment import ShmSegment, cuda_host_register, cuda_host_unregister, process_start_ticks

NS_PER_S = 1_000_000_000
LIVENESS_CHECK_INTERVAL_S = 0.001     # client: how often a waiting call checks that the worker lives
CLIENT_SPIN_S = 0.002                 # client: spin this long in wait() before sleeping between checks
CLIENT_SLEEP_S = 50e-6
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


class WorkerDead(RuntimeError):
    """The CPU worker process is gone (or restarted): fall back to fetching; reconnect after a restart."""


class WorkerTimeout(TimeoutError):
    """The CPU worker lives but did not answer in time (stopped, hung or overloaded)."""


class WorkerError(RuntimeError):
    """The CPU worker answered with an error status (bad request, compute error)."""


class _Words:
    """The doorbell words as a memoryview of int64 (a load or store is one aligned 8-byte access)."""

    def __init__(self, views: ChannelViews):
        def word(arr: np.ndarray) -> memoryview:
            return memoryview(arr).cast("B").cast("q")

        self.request_seq = word(views.request_seq)
        self.done_seq = word(views.done_seq)
        self.heartbeat_ns = word(views.heartbeat_ns)
        self.worker_pid = word(views.worker_pid)
        self.worker_epoch = word(views.worker_epoch)
        self.worker_state = word(views.worker_state)


@dataclasses.dataclass
class _SlotTensors:
    hidden: torch.Tensor       # [T_max, H] bf16 or fp32
    token_idx: torch.Tensor    # [max_triples] int32
    expert_id: torch.Tensor    # [max_triples] int32
    weight: torch.Tensor       # [max_triples] fp32
    out: torch.Tensor          # [T_max, H] fp32
    # Prefix views by length: slicing a torch tensor costs ~1.5 us, a dict hit ~0.1 us.
    _token_views: dict = dataclasses.field(default_factory=dict)
    _triple_views: dict = dataclasses.field(default_factory=dict)

    def token_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden[:T], out[:T])"""
        views = self._token_views.get(num_tokens)
        if views is None:
            views = self._token_views[num_tokens] = (self.hidden[:num_tokens], self.out[:num_tokens])
        return views

    def triple_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_idx[:n], expert_id[:n], weight[:n])"""
        views = self._triple_views.get(n)
        if views is None:
            views = self._triple_views[n] = (self.token_idx[:n], self.expert_id[:n], self.weight[:n])
        return views


class _Lines:
    """One slot's request and response lines as memoryviews of their fields (REQUEST_LINE / RESPONSE_LINE)."""

    def __init__(self, request: np.ndarray, response: np.ndarray):
        def field(line: np.ndarray, name: str) -> memoryview:
            ftype, offset = line.dtype.fields[name][:2]
            raw = line.view(np.uint8)[offset:offset + ftype.itemsize]
            return memoryview(raw).cast("B").cast("q" if ftype.itemsize == 8 else "i")

        self.req_seq, self.req_layer = field(request, "seq"), field(request, "layer")
        self.req_tokens, self.req_triples = field(request, "num_tokens"), field(request, "num_triples")
        self.req_split_limit, self.req_split_expert = field(request, "split_limit"), field(request, "split_expert")
        self.resp_seq, self.resp_status = field(response, "seq"), field(response, "status")
        self.resp_experts, self.resp_compute_ns = field(response, "num_experts"), field(response, "compute_ns")


def _slot_tensors(views: ChannelViews) -> list[_SlotTensors]:
    tensors = []
    for slot in views.slots:
        hidden = torch.from_numpy(slot.hidden)
        if views.layout.hidden_dtype == "bfloat16":
            hidden = hidden.view(torch.bfloat16)
        tensors.append(_SlotTensors(hidden, torch.from_numpy(slot.token_idx), torch.from_numpy(slot.expert_id),
                                    torch.from_numpy(slot.weight), torch.from_numpy(slot.out)))
    return tensors


class ChannelEnd:
    """What both ends of a channel map: the segment, its views, doorbell words and slot tensors."""

    def __init__(self, channel_name: str):
        self._seg, self.layout = attach_channel(channel_name)
        self.name = channel_name
        self._views = ChannelViews(self._seg, self.layout)
        self._words = _Words(self._views)
        self._slots = _slot_tensors(self._views)
        self._lines = [_Lines(slot.request, slot.response) for slot in self._views.slots]


def check_split_fields(split_expert: int, split_limit: int) -> None:
    """The client's check of a split (it does not know I or E; the worker checks those): split_limit 0 (no
    split) or a positive multiple of SPLIT_CHANNEL_UNIT with split_expert >= 0; both fit an int32."""
    if not INT32_MIN <= split_expert <= INT32_MAX:
        raise ValueError(f"split_expert {split_expert} does not fit an int32")
    if split_limit == 0:
        return
    if not 0 < split_limit <= INT32_MAX or split_limit % SPLIT_CHANNEL_UNIT:
        raise ValueError(f"split_limit {split_limit} must be 0 (no split) or a positive multiple of "
                         f"{SPLIT_CHANNEL_UNIT}")
    if split_expert < 0:
        raise ValueError(f"split_expert {split_expert} must name an expert (>= 0) with split_limit {split_limit}")


class CpuPoolClient(ChannelEnd):
    """The GPU worker's end of one CPU worker's channel."""

    def __init__(self, channel_name: str):
        super().__init__(channel_name)
        self._pending: list[tuple[int, int, int] | None] = [None] * NUM_SLOTS    # (seq, num_tokens, layer) per slot
        self._pid = 0
        self._epoch = -1
        self._pidfd: int | None = None
        self._start_ticks: int | None = None
        self._pinned = False

    # -- connection -----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._pid > 0

    @property
    def worker_pid(self) -> int:
        return self._pid

    def wait_for_worker(self, timeout_s: float) -> int:
        """Block until a live worker serves the channel with nothing in flight; returns its pid."""
        self._disconnect()
        w = self._words
        deadline = time.monotonic() + timeout_s
        while True:
            pid, epoch, state = w.worker_pid[0], w.worker_epoch[0], w.worker_state[0]
            if (state == WORKER_SERVING and pid > 0 and process_start_ticks(pid) is not None
                    and w.done_seq[0] >= w.request_seq[0]):
                self._connect(pid, epoch)
                return pid
            if time.monotonic() > deadline:
                raise WorkerTimeout(f"no CPU worker serves channel {self.name!r} after {timeout_s:.1f} s (state "
                                    f"{WORKER_STATE_NAMES.get(state, state)}, pid {pid}, request_seq "
                                    f"{int(w.request_seq[0])}, done_seq {int(w.done_seq[0])}); start `ft worker "
                                    "cpu` for it or check its log")
            time.sleep(0.001)

    def _connect(self, pid: int, epoch: int) -> None:
        try:
            self._pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):      # not Linux >= 5.3: fall back to /proc checks
            self._pidfd = None
        self._start_ticks = process_start_ticks(pid)
        self._pid, self._epoch = pid, epoch
        self._pending = [None] * NUM_SLOTS

    def _disconnect(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd = None
        self._pid = 0

    def worker_alive(self) -> bool:
        if self._pid <= 0:
            return False
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            if readable:
                return False
        elif process_start_ticks(self._pid) != self._start_ticks:
            return False
        return self._words.worker_epoch[0] == self._epoch and self._words.worker_state[0] != WORKER_STOPPED

    def heartbeat_age_s(self) -> float:
        return (time.monotonic_ns() - self._words.heartbeat_ns[0]) / NS_PER_S

    # -- GPU stream access ----------------------------------------------------------------------
    def pin_for_cuda(self) -> bool:
        """cudaHostRegister the whole channel (doorbell + buffers), so copy engines can move hidden
        states and partial sums directly and the stream can write/await the counters. False without CUDA."""
        if not self._pinned:
            self._pinned = cuda_host_register(self._seg.address, self._seg.nbytes,
                                              what=f"CPU-worker channel {self.name!r}")
        return self._pinned

    def doorbell_addresses(self) -> dict[str, int]:
        """Host addresses of the 8-byte counters (for cuStreamWriteValue64 / cuStreamWaitValue64 after
        pin_for_cuda; with unified addressing the device pointer is the same address)."""
        base = self._seg.address
        return {"request_seq": base + REQUEST_SEQ_OFFSET, "done_seq": base + DONE_SEQ_OFFSET,
                "heartbeat_ns": base + HEARTBEAT_NS_OFFSET}

    def slot_addresses(self, layer: int) -> dict[str, int]:
        """Host addresses of the buffers of layer `layer`'s slot (see ChannelLayout.slot_offsets)."""
        base = self._seg.address
        return {name: base + offset for name, offset in self.layout.slot_offsets(layer % NUM_SLOTS).items()}

    # -- requests -------------------------------------------------------------------------------
    def submit(self, layer: int, hidden: torch.Tensor, triples: Sequence[torch.Tensor | np.ndarray], *,
               split_expert: int = -1, split_limit: int = 0) -> int:
        """Hand layer `layer`'s CPU share to the worker; returns the request's sequence number.

        hidden: [T, H] (cast to the channel's dtype); triples: (token_idx [n] int, expert_id [n] int,
        weight [n] float). The slot is ``layer % 2``; its previous request must have been waited for.
        split_limit > 0: the worker computes expert split_expert over channels [0, split_limit) only (a
        multiple of SPLIT_CHANNEL_UNIT, below I: the worker answers a bad request otherwise); 0: no split.
        """
        if not self.connected:
            raise WorkerDead(f"channel {self.name!r} has no connected CPU worker; call wait_for_worker()")
        check_split_fields(split_expert, split_limit)
        token_idx, expert_id, weight = triples
        num_tokens, hidden_size = hidden.shape
        n = len(token_idx)
        if hidden_size != self.layout.hidden or num_tokens > self.layout.t_max:
            raise ValueError(f"hidden {tuple(hidden.shape)} does not fit channel {self.name!r} "
                             f"(T <= {self.layout.t_max}, H = {self.layout.hidden})")
        if n > self.layout.max_triples or len(expert_id) != n or len(weight) != n:
            raise ValueError(f"{n} triples (expert_id {len(expert_id)}, weight {len(weight)}) do not fit channel "
                             f"{self.name!r} (max {self.layout.max_triples}, equal lengths)")
        slot_index = layer % NUM_SLOTS
        if self._pending[slot_index] is not None:
            raise RuntimeError(f"slot {slot_index} still holds request {self._pending[slot_index][0]}; "
                               f"wait() for layer {layer - NUM_SLOTS} before submitting layer {layer}")
        slot, lines = self._slots[slot_index], self._lines[slot_index]
        slot.token_views(num_tokens)[0].copy_(hidden)
        if n:
            dst_token, dst_expert, dst_weight = slot.triple_views(n)
            dst_token.copy_(torch.as_tensor(token_idx))
            dst_expert.copy_(torch.as_tensor(expert_id))
            dst_weight.copy_(torch.as_tensor(weight))
        seq = int(self._words.request_seq[0]) + 1
        lines.req_layer[0] = layer
        lines.req_tokens[0] = num_tokens
        lines.req_triples[0] = n
        lines.req_split_limit[0] = split_limit       # both, on every request: no split outlives its request
        lines.req_split_expert[0] = split_expert
        lines.req_seq[0] = seq                   # the request line is complete ...
        self._words.request_seq[0] = seq         # ... before the doorbell rings (x86-64 stores are ordered)
        self._pending[slot_index] = (seq, num_tokens, layer)
        return seq

    def wait(self, layer: int, deadline_s: float) -> torch.Tensor:
        """Partial sums [T, H] fp32 of layer `layer`'s request: a view of the response buffer, valid until
        the next submit into the same slot (layer + 2). Gives up `deadline_s` seconds after the call."""
        slot_index = layer % NUM_SLOTS
        pending = self._pending[slot_index]
        if pending is None:
            raise RuntimeError(f"no request in flight for layer {layer} (slot {slot_index})")
        seq, num_tokens, _ = pending
        done = self._words.done_seq
        start = time.monotonic()
        if done[0] < seq:
            next_check = start + LIVENESS_CHECK_INTERVAL_S
            spin_until = start + CLIENT_SPIN_S
            give_up = start + deadline_s
            while done[0] < seq:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + LIVENESS_CHECK_INTERVAL_S
                    if not self.worker_alive():
                        self._fail()
                        raise WorkerDead(f"CPU worker{self._pid_for_message()} of channel {self.name!r} died "
                                         f"with layer {layer} (request {seq}) in flight; the coordinator restarts "
                                         "it, meanwhile fetch instead")
                    if now >= give_up:
                        age = self.heartbeat_age_s()
                        self._fail()
                        raise WorkerTimeout(f"CPU worker of channel {self.name!r} did not finish layer {layer} "
                                            f"(request {seq}) within {deadline_s * 1e3:.1f} ms; its last heartbeat "
                                            f"was {age * 1e3:.1f} ms ago")
                if now >= spin_until:
                    time.sleep(CLIENT_SLEEP_S)
        self._pending[slot_index] = None
        lines = self._lines[slot_index]
        if lines.resp_seq[0] != seq and not self.worker_alive():
            # A replacement claimed the channel (done_seq jumped) before this wait saw the death.
            self._fail()
            raise WorkerDead(f"the CPU worker of channel {self.name!r} was replaced with layer {layer} (request "
                             f"{seq}) in flight; reconnect with wait_for_worker(), meanwhile fetch instead")
        if lines.resp_seq[0] != seq:
            raise WorkerError(f"channel {self.name!r}: response for request {lines.resp_seq[0]}, expected {seq} "
                              f"({STATUS_NAMES[STATUS_PROTOCOL_ERROR]})")
        status = lines.resp_status[0]
        if status != STATUS_OK:
            raise WorkerError(f"CPU worker answered layer {layer} with {STATUS_NAMES.get(status, status)}; "
                              "see its log")
        return self._slots[slot_index].token_views(num_tokens)[1]

    def call(self, layer: int, hidden: torch.Tensor, triples: Sequence[torch.Tensor | np.ndarray],
             deadline_s: float, *, split_expert: int = -1, split_limit: int = 0) -> torch.Tensor:
        self.submit(layer, hidden, triples, split_expert=split_expert, split_limit=split_limit)
        return self.wait(layer, deadline_s)

    def drain(self, deadline_s: float) -> int:
        """Wait for every request still in flight and drop its answer: for a caller that raised between submit and
        wait, so that the next submit into those slots finds them free. Returns how many it waited for. A worker
        that dies or misses the deadline raises as in `wait` (and is disconnected); an error status is dropped."""
        drained = 0
        for pending in list(self._pending):
            if pending is not None:
                drained += 1
                try:
                    self.wait(pending[2], deadline_s)           # the layer it was submitted for
                except WorkerError:
                    pass
        return drained

    def last_compute_ns(self, layer: int) -> int:
        return self._lines[layer % NUM_SLOTS].resp_compute_ns[0]

    def _pid_for_message(self) -> str:
        return f" (pid {self._pid})" if self._pid else ""

    def _fail(self) -> None:
        """After WorkerDead/WorkerTimeout: disconnected until wait_for_worker() succeeds again."""
        self._disconnect()
        self._pending = [None] * NUM_SLOTS

    def close(self) -> None:
        self._disconnect()
        if self._pinned:
            cuda_host_unregister(self._seg.address)
            self._pinned = False
        del self._slots, self._lines, self._views, self._words
        self._seg.close()
