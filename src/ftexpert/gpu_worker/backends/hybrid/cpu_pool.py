"""`CpuPool`: the CPU expert workers of one expert store, as the GPU worker sees them.

    pool = CpuPool.attach(store, channel_names, deadline_s=1.0, readmit_poll_s=0.02, ready_timeout_s=120)
    shares = pool.submit(layer, hidden_host, token_idx, expert_id, weight)   # [T, H], [n] each
    ...                                                                        # GPU work meanwhile
    failed = pool.join(layer, shares, out=partial)    # partial [T, H] fp32 = sum of the workers' sums
    pool.poll()                                       # re-admit restarted workers (rate-limited)

The channels and the workers belong to the coordinator's ExpertResources (coordinator/expert_resources.py:
created there, outliving GPU-worker restarts; each worker a `ft worker cpu` process under its supervisor,
restarted with back-off after an exit); the pool only talks to them. Triples go to the worker that owns
their expert (`ExpertSplit`, contiguous ranges). A worker that dies (WorkerDead) or misses the deadline
(WorkerTimeout) is marked down; a late one is killed (SIGKILL: a stopped or hung process may never
answer, and a restart costs a few seconds with the store still mapped), so its supervisor restarts it.
`poll` re-admits a worker once its channel answers again (READY and nothing in flight). Where the owner
runs in this process (`ft generate`, `ft serve --workers inline`), `worker_info` reads its supervisor's
view (pids, restarts, a worker it gave up on).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any, Callable

import numpy as np
import torch

from ftexpert.proto.cpu_channel import CpuPoolClient, WorkerDead, WorkerError, WorkerTimeout
from ftexpert.proto.expert_owners import ExpertSplit
from ftexpert.proto.expert_store import ExpertStore
from ftexpert.proto.shm_segment import process_start_ticks

log = logging.getLogger("ft.hybrid.pool")
NOT_BACK_LOG_S = 10.0        # a failed worker still not re-admitted: say why again this often

@dataclasses.dataclass
class PoolMember:
    index: int
    name: str                      # supervisor name and telemetry key: "cpu<index>"
    channel_name: str
    client: CpuPoolClient
    serving: bool = False          # takes work now
    gave_up: bool = False          # its supervisor stopped restarting it
    pid: int = 0                   # the process that served when it was admitted
    start_ticks: int | None = None  # its start time (a kill must not hit a reused pid)
    failures_total: int = 0
    readmissions_total: int = 0
    kills_total: int = 0           # late workers this pool killed for a restart
    last_error: str = ""
    waiting_for: str = ""          # why a failed worker is not re-admitted yet (CpuPool._not_back)
    waiting_logged_s: float = 0.0


@dataclasses.dataclass
class Share:
    """One worker's part of a layer's CPU share."""
    member: PoolMember
    rows: np.ndarray               # [n_w] indices into the layer's triples
    num_experts: int               # distinct experts among them
    error: Exception | None = None
    compute_s: float = 0.0


class CpuPool:
    def __init__(self, store: ExpertStore, *, num_workers: int, t_max: int, max_triples: int, hidden_dtype: str,
                 deadline_s: float, readmit_poll_s: float,
                 worker_info: Callable[[], list[dict[str, Any]]] | None = None):
        self.store = store
        self.num_workers = num_workers
        self.t_max, self.max_triples, self.hidden_dtype = t_max, max_triples, hidden_dtype
        self.deadline_s, self.readmit_poll_s = deadline_s, readmit_poll_s
        self.split = ExpertSplit.contiguous(store.num_layers, store.num_experts, num_workers)
        self.members: list[PoolMember] = []
        self.worker_info = worker_info             # the owner's supervisor view, where it runs in this process
        self._next_poll_s = 0.0

    # -- life cycle -------------------------------------------------------------------------------
    @classmethod
    def attach(cls, store: ExpertStore, channel_names: list[str], *, deadline_s: float, readmit_poll_s: float,
               ready_timeout_s: float, worker_info: Callable[[], list[dict[str, Any]]] | None = None) -> "CpuPool":
        """Clients on existing channels (worker i serves channel_names[i]); whoever started the workers
        restarts them. Channels and workers are left alone by close()."""
        first = CpuPoolClient(channel_names[0])
        lay = first.layout
        pool = cls(store, num_workers=len(channel_names), t_max=lay.t_max, max_triples=lay.max_triples,
                   hidden_dtype=lay.hidden_dtype, deadline_s=deadline_s, readmit_poll_s=readmit_poll_s,
                   worker_info=worker_info)
        try:
            for i, name in enumerate(channel_names):
                client = first if i == 0 else CpuPoolClient(name)
                pool.members.append(PoolMember(i, f"cpu{i}", name, client))
                if (client.layout.t_max, client.layout.max_triples) != (lay.t_max, lay.max_triples):
                    raise ValueError(f"channel {name!r} is sized differently from {channel_names[0]!r}; create "
                                     "every channel of a pool with the same t_max and max_triples")
            pool._admit_all(ready_timeout_s)
        except BaseException:
            if not pool.members:
                first.close()
            pool.close()
            raise
        return pool

    def _admit_all(self, timeout_s: float) -> None:
        for m in self.members:
            self._admit(m, m.client.wait_for_worker(timeout_s=timeout_s))
        log.info("CPU pool: %d worker(s) serving store %r (pids %s)", self.num_workers, self.store.name,
                 ", ".join(str(m.pid) for m in self.members))

    @staticmethod
    def _admit(m: PoolMember, pid: int) -> None:
        m.pid, m.start_ticks, m.serving = pid, process_start_ticks(pid), True

    def close(self) -> None:
        for m in self.members:
            m.client.close()
        self.members = []

    # -- state ------------------------------------------------------------------------------------
    @property
    def all_serving(self) -> bool:
        return bool(self.members) and all(m.serving for m in self.members)

    def fits(self, num_tokens: int, num_triples: int) -> bool:
        return num_tokens <= self.t_max and num_triples <= self.max_triples

    def worker_pids(self) -> dict[str, int]:
        """Current process of every worker, as its supervisor sees it (0 while restarting; {}: not known here)."""
        return {w["name"]: w["pid"] for w in self.worker_info()} if self.worker_info is not None else {}

    def restarts(self) -> dict[str, int]:
        return {w["name"]: w["restarts"] for w in self.worker_info()} if self.worker_info is not None else {}

    def set_shares(self, shares: dict[str, float]) -> None:
        """Re-split the experts among the workers in proportion to `shares` (name -> weight), as
        the coordinator's tuner measured them; workers missing from `shares` keep the mean share."""
        known = {m.name for m in self.members}
        unknown = sorted(set(shares) - known)
        if unknown:
            raise ValueError(f"cpu_shares names unknown worker(s) {', '.join(unknown)}; this pool has "
                             f"{', '.join(sorted(known))}")
        if not shares:
            return
        mean = sum(shares.values()) / len(shares)
        weights = [float(shares.get(m.name, mean)) for m in self.members]
        self.split = ExpertSplit.proportional(self.store.num_layers, self.store.num_experts, weights)

    # -- hot path ---------------------------------------------------------------------------------
    def submit(self, layer: int, hidden: torch.Tensor, token_idx: np.ndarray, expert_id: np.ndarray,
               weight: np.ndarray) -> list[Share]:
        """Hand each owner its triples. hidden [T, H] host (channel dtype); token_idx, expert_id [n] int32,
        weight [n] fp32 (ORIGINAL expert ids). A worker that cannot take its share is marked failed in it."""
        shares = []
        for m, rows in zip(self.members, self.split.split_triples(layer, expert_id)):
            if rows.size == 0:
                continue
            experts = expert_id[rows]
            share = Share(m, rows, int(np.unique(experts).size))
            try:
                m.client.submit(layer, hidden, (token_idx[rows], experts, weight[rows]))
            except WorkerDead as exc:
                share.error = exc
                self._fail(m, exc)
            shares.append(share)
        return shares

    def join(self, layer: int, shares: list[Share], out: torch.Tensor) -> list[Share]:
        """Wait for every share; out [T, H] fp32 (host) = sum of the answered partial sums, in worker order
        (zeros if none answered). Returns the shares that failed: the caller computes those otherwise."""
        failed, first = [], True
        for share in shares:
            if share.error is None:
                m = share.member
                try:
                    partial = m.client.wait(layer, deadline_s=self.deadline_s)       # [T, H] fp32 view
                except (WorkerDead, WorkerTimeout) as exc:
                    share.error = exc
                    self._fail(m, exc)
                except WorkerError as exc:       # answered with an error status: fetch this share, keep it
                    share.error = exc
                    m.failures_total += 1
                    m.last_error = str(exc)
                    log.error("CPU worker %s: %s; fetching its share of layer %d instead", m.name, exc, layer)
                else:
                    share.compute_s = m.client.last_compute_ns(layer) / 1e9
                    if first:
                        out.copy_(partial)
                    else:
                        out.add_(partial)
                    first = False
            if share.error is not None:
                failed.append(share)
        if first:
            out.zero_()
        return failed

    def drain(self) -> int:
        """Wait for every share still in flight and drop the answers (a layer call that raised between `submit` and
        `join`); a worker that dies or misses the deadline meanwhile is failed as in `join`. Returns how many."""
        drained = 0
        for m in self.members:
            try:
                drained += m.client.drain(self.deadline_s)
            except (WorkerDead, WorkerTimeout) as exc:
                self._fail(m, exc)
        return drained

    def mark_failed(self, m: PoolMember, exc: Exception) -> None:
        """A share of m failed outside submit/join (the device hand-off's join kernel gave up): as join would (a
        late worker, WorkerTimeout, is killed for a restart)."""
        self._fail(m, exc)

    def _fail(self, m: PoolMember, exc: Exception) -> None:
        m.serving = False
        m.failures_total += 1
        m.last_error = str(exc)
        if isinstance(exc, WorkerTimeout):
            # A worker that missed its deadline is killed and restarted: stopped or hung, it may never
            # answer; overloaded, it would keep the GPU waiting. Only the process we admitted is killed.
            if m.pid > 0 and m.start_ticks is not None and process_start_ticks(m.pid) == m.start_ticks:
                try:
                    os.kill(m.pid, signal.SIGKILL)
                    m.kills_total += 1
                except ProcessLookupError:
                    pass
            log.error("CPU worker %s (pid %d) missed its %.0f ms deadline: killed for a restart; fetching "
                      "instead meanwhile", m.name, m.pid, self.deadline_s * 1e3)
        else:
            log.error("CPU worker %s (pid %d) is gone (%s); the supervisor restarts it, fetching instead "
                      "meanwhile", m.name, m.pid, exc)

    def poll(self) -> list[PoolMember]:
        """Re-admit workers whose channel serves again (at most every readmit_poll_s); returns them."""
        now = time.monotonic()
        if now < self._next_poll_s or self.all_serving:
            return []
        self._next_poll_s = now + self.readmit_poll_s
        self._note_given_up()
        back = []
        for m in self.members:
            if m.serving or m.gave_up:
                continue
            try:
                pid = m.client.wait_for_worker(timeout_s=0)
            except WorkerTimeout as exc:
                self._not_back(m, str(exc))
                continue
            if pid == m.pid and process_start_ticks(pid) == m.start_ticks:
                # The process that failed (dead, or killed for lateness, and not reaped yet): its channel
                # can look served when a stream doorbell's watchdog released done_seq. Not re-admitted.
                self._not_back(m, f"channel {m.channel_name!r} is still served by the failed process {pid}")
                continue
            m.waiting_for = ""
            self._admit(m, pid)
            m.readmissions_total += 1
            back.append(m)
            log.warning("CPU worker %s re-admitted (pid %d)", m.name, m.pid)
        return back

    @staticmethod
    def _not_back(m: PoolMember, why: str) -> None:
        """Log why a failed worker is not re-admitted yet: when the reason changes, and every
        NOT_BACK_LOG_S while it stays (operators and tests see a re-admission that never comes)."""
        now = time.monotonic()
        if why != m.waiting_for or now - m.waiting_logged_s >= NOT_BACK_LOG_S:
            m.waiting_for, m.waiting_logged_s = why, now
            log.info("CPU worker %s not re-admitted yet: %s", m.name, why)

    def _note_given_up(self) -> None:
        """Workers whose supervisor gave up on them (state "failed") are not waited for again."""
        if self.worker_info is None:
            return
        failed = {w["name"] for w in self.worker_info() if w["state"] == "failed"}
        for m in self.members:
            if m.name in failed and not m.gave_up:
                m.gave_up, m.serving = True, False
                log.error("CPU worker %s: its supervisor gave up restarting it; the backend keeps fetching its "
                          "share", m.name)
