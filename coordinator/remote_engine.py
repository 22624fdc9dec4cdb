"""`RemoteEngine`: the engine contract (add_request / step / abort / has_work / stats / set_policy) over the
engine link to a GPU worker process, so EngineService, the HTTP API and gRPC run unchanged on top of it.

Only the engine thread calls it, as with the in-process Engine. It sends ADD_REQUEST / ABORT through
the link's IO thread and drains the link's event queue: `step()` waits up to STEP_WAIT_S for the next
TOKEN_BATCH, so requests and aborts queued meanwhile by the front doors reach the worker within that.

Request ids are the coordinator's own ints; each request remembers the worker session it was sent to.
When that session is lost (the worker died, hung, or was replaced), each of its requests comes out of
`step()` as a 5-tuple whose last element is an EngineUnavailable: the stream ends with a clear error
(HTTP 503, gRPC UNAVAILABLE) and the requests of a newer session are untouched. While no worker is
READY, `add_request` raises EngineUnavailable (the client gets 503 and retries).
"""
from __future__ import annotations

import itertools
import logging
import queue
from typing import Any, Callable, Hashable, Sequence

from coordinator.engine_link import EngineLinkServer
from coordinator.engine_service import EngineUnavailable
from proto import engine_messages as em

log = logging.getLogger("ft.coordinator.remote_engine")

STEP_WAIT_S = 0.01                # step(): longest wait for the worker's next TOKEN_BATCH
MAX_EVENTS_PER_PUMP = 10_000
POLICY_FIELDS = ("strategy", "fetch_fraction", "fetch_round", "cpu_shares")


class RemoteEngine:
    kind = "gpu-worker"

    def __init__(self, link: EngineLinkServer, *, vocab_size: int, restart_worker: Callable[[], None] | None = None):
        self.link = link
        self.vocab_size = vocab_size
        self._restart_worker = restart_worker
        self._ids = itertools.count(1)
        self._in_flight: dict[int, int] = {}            # request id -> session it was sent to
        self._outputs: list[tuple] = []
        self._session = 0                               # the READY session, 0 while none
        self._stats: dict[str, float] = {}
        self._policy: dict[str, Any] | None = None
        self.facts: em.Ready | None = None
        self.last_error = "no GPU worker has connected yet"
        self.sessions_ready_total = 0
        self.sessions_lost_total = 0
        self.requests_failed_total = 0
        facts = link.ready_facts
        peer = link.peer
        if facts is not None and peer is not None:       # READY before we were built: adopt it
            self._adopt(peer.session, facts)

    # ------------------------------------------------------------------ engine contract

    @property
    def max_context_tokens(self) -> int:
        return self.facts.max_context_tokens if self.facts is not None else 0

    @property
    def healthy(self) -> bool:
        self._pump()
        return self._session != 0

    @property
    def pid(self) -> int:
        return self.link.peer_pid if self._session else 0

    def add_request(self, prompt_ids: Sequence[int], params: Any, request_id: Hashable | None = None) -> int:
        self._pump()
        if not self._session:
            raise EngineUnavailable(f"the GPU worker is not ready ({self.last_error}); it is being (re)started: "
                                    f"retry in a few seconds")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("the prompt is empty; send at least one token")
        if len(ids) > self.max_context_tokens:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_context_tokens="
                             f"{self.max_context_tokens}; shorten it")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        rid = next(self._ids)
        seed = getattr(params, "seed", None)
        self.link.send_to(self._session, em.AddRequest(
            rid, em.pack_token_ids(ids), int(params.max_new_tokens), float(params.temperature), float(params.top_p),
            int(params.top_k), int(seed) if seed is not None else 0, seed is not None, bool(params.ignore_eos),
            [int(t) for t in params.stop_token_ids]))
        self._in_flight[rid] = self._session
        return rid

    def abort(self, request_id: Hashable) -> bool:
        session = self._in_flight.pop(request_id, None)       # type: ignore[arg-type]
        if session is None:
            return False
        self.link.send_to(session, em.Abort([int(request_id)]))   # type: ignore[arg-type]
        return True

    def has_work(self) -> bool:
        self._pump()
        return bool(self._in_flight or self._outputs)

    def step(self) -> list[tuple]:
        self._pump(wait_s=0.0 if self._outputs else STEP_WAIT_S)
        outputs, self._outputs = self._outputs, []
        return outputs

    @property
    def stats(self) -> dict[str, float]:
        self._pump()
        return {**self._stats, "link.sessions_ready_total": float(self.sessions_ready_total),
                "link.sessions_lost_total": float(self.sessions_lost_total),
                "link.requests_in_flight": float(len(self._in_flight))}

    def set_policy(self, **fields: Any) -> None:
        fields = {"cpu_shares": {}, **fields}          # no split given: the worker keeps its own
        self._policy = {k: fields[k] for k in POLICY_FIELDS if k in fields}
        self._push_policy()

    # ------------------------------------------------------------------ restarts

    def restart_worker(self) -> None:
        """Operator restart (RestartWorker "engine"): the worker process is replaced; its requests fail."""
        if self._restart_worker is not None:
            self._restart_worker()
        elif self._session:
            self.link.send_to(self._session, em.Shutdown("restart requested by an operator"))

    # ------------------------------------------------------------------ events

    def _push_policy(self) -> None:
        p = self._policy
        if not self._session or not p or len(p) != len(POLICY_FIELDS):
            return
        shares = dict(p["cpu_shares"] or {})
        self.link.send_to(self._session, em.SetPolicy(str(p["strategy"]), float(p["fetch_fraction"]),
                                                      str(p["fetch_round"]),
                                                      [str(n) for n in shares],
                                                      [float(v) for v in shares.values()]))

    def _adopt(self, session: int, facts: em.Ready) -> None:
        self._session = session
        self.facts = facts
        self.last_error = ""
        self.sessions_ready_total += 1
        self._push_policy()

    def _pump(self, wait_s: float = 0.0) -> None:
        events = self.link.events
        for n in range(MAX_EVENTS_PER_PUMP):
            try:
                event = events.get(timeout=wait_s) if n == 0 and wait_s > 0 else events.get_nowait()
            except queue.Empty:
                return
            kind, session, payload = event
            if kind == "ready":
                if session > self._session:
                    self._adopt(session, payload)
            elif kind == "lost":
                self._on_lost(session, payload)
            elif kind == "msg":
                self._on_message(session, payload)

    def _on_lost(self, session: int, reason: str) -> None:
        if session == self._session:
            self._session = 0
            self.last_error = reason
            self._stats = {}
        self.sessions_lost_total += 1
        failed = [rid for rid, s in self._in_flight.items() if s == session]
        if not failed:
            return
        error = EngineUnavailable(f"{reason} while generating this request; the coordinator restarts it: retry "
                                  f"in a few seconds")
        for rid in failed:
            del self._in_flight[rid]
            self._outputs.append((rid, None, True, "abort", error))
        self.requests_failed_total += len(failed)

    def _on_message(self, session: int, msg: Any) -> None:
        if isinstance(msg, em.TokenBatch):
            for rid, token, finished, reason in zip(msg.request_ids, msg.token_ids, msg.finished, msg.finish_reasons):
                if self._in_flight.get(rid) != session:
                    continue                      # aborted meanwhile
                if finished:
                    del self._in_flight[rid]
                self._outputs.append((rid, token, finished, reason or None))
        elif isinstance(msg, em.RequestFailed):
            if self._in_flight.get(msg.request_id) == session:
                del self._in_flight[msg.request_id]
                self._outputs.append((msg.request_id, None, True, "abort", f"the GPU worker refused the request: "
                                                                           f"{msg.message}"))
                self.requests_failed_total += 1
        elif isinstance(msg, em.Stats):
            if session == self._session:
                self._stats = dict(zip(msg.names, msg.values))
        elif isinstance(msg, em.Error):
            self.last_error = msg.message
        elif isinstance(msg, em.Drained):
            log.info("GPU worker drained: %d finished, %d aborted", msg.finished, msg.aborted)

