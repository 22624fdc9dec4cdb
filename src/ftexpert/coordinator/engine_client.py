"""`EngineClient`: the engine as the coordinator's event loop sees it, one declared contract for both modes.

EngineService calls it on the event loop and nowhere else:

    await start(events)        connect; from now on `events` (EngineEvents) hears of tokens, failures, stats
    submit(prompt, params)     -> request id (EngineUnavailable while no engine is ready)
    abort(request_id)          frees the engine's slots; no event follows for that id
    set_policy(SetPolicy)      the fetch policy; kept and sent again to every engine that becomes ready
    stats / health()           the last STATS the engine sent (flattened, cumulative) / ready, kind, pid, error
    await restart()            replace the engine (an operator's RestartWorker "engine")
    await stop()

Both implementations speak the engine link's messages (proto/engine_messages.py) to the GPU worker's loop
(gpu_worker/worker_loop.py) and differ only in transport: `RemoteEngine` (coordinator/remote_engine.py) over
ZMQ to a worker process, `InlineEngine` (coordinator/inline_engine.py) to that loop in a thread of this
process. Their transport thread hands each event to the loop with `call_soon_threadsafe`; `LinkedEngineClient`
below handles them there. Each engine instance is a *session*: when one is lost (the process died, went
silent, was replaced or restarted), each of its requests fails with EngineUnavailable (HTTP 503, gRPC
UNAVAILABLE) and the requests of a newer session are untouched.
"""
from __future__ import annotations

import abc
import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ftexpert.proto import engine_messages as em
from ftexpert.proto.sampling_params import SamplingParams, TokenLogprobs

log = logging.getLogger("ft.coordinator.engine_client")


class EngineError(Exception):
    """The engine failed this request (a step raised, it was refused, restarted). HTTP 500 / gRPC INTERNAL."""


class EngineUnavailable(EngineError):
    """The engine is gone or not ready yet (it is being restarted, drained, stopped): the client may retry.
    HTTP 503 with Retry-After / gRPC UNAVAILABLE."""


class EngineFailed(EngineUnavailable):
    """No engine will serve again without an operator: the supervisor gave up restarting the GPU worker.
    HTTP 503 `engine_failed` without Retry-After / gRPC UNAVAILABLE."""


class EngineEvents(Protocol):
    """What the engine tells EngineService, on the event loop."""

    def on_tokens(self, outputs: list[tuple[int, int, bool, str | None, TokenLogprobs | None]]) -> None:
        """One engine step: (request id, token id, finished, finish reason, logprobs or None) per request of ours."""

    def on_request_failed(self, request_id: int, error: EngineError) -> None:
        """This request ends with `error` (no more events for it)."""

    def on_stats(self, stats: dict[str, float]) -> None:
        """A fresh stats snapshot (flattened, cumulative counters)."""


@dataclass(frozen=True)
class EngineHealth:
    ready: bool
    kind: str                 # "gpu-worker" or "in-process"
    pid: int                  # the engine's process (0 while none)
    last_error: str


class EngineClient(abc.ABC):
    kind: str

    @abc.abstractmethod
    async def start(self, events: EngineEvents) -> None: ...

    @abc.abstractmethod
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> int: ...

    @abc.abstractmethod
    def abort(self, request_id: int) -> None: ...

    @abc.abstractmethod
    def set_policy(self, policy: em.SetPolicy) -> None: ...

    @property
    @abc.abstractmethod
    def stats(self) -> dict[str, float]: ...

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    async def restart(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...


class LinkedEngineClient(EngineClient):
    """The engine-link protocol on the event loop; a subclass provides the transport: `_send(session, msg)`,
    `_pid()`, start / restart / stop, and calls `_post(kind, session, payload)` from its transport thread:

        ("ready", session, Ready | None)   an engine serves (a newer session replaces the current one)
        ("lost", session, reason)          that session's engine is gone; its requests fail
        ("gave_up", session, reason)       ... and nothing will restart it (EngineFailed until one is ready)
        ("msg", session, message)          TOKEN_BATCH / REQUEST_FAILED / STATS / DRAINED / ERROR
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: EngineEvents | None = None
        self._ids = itertools.count(1)
        self._in_flight: dict[int, int] = {}          # request id -> the session it was sent to
        self._session = 0                             # the ready session, 0 while none
        self._stats: dict[str, float] = {}
        self._policy: em.SetPolicy | None = None
        self.facts: em.Ready | None = None
        self.last_error = "no engine has become ready yet"
        self.gave_up: str | None = None               # the supervisor stopped restarting the engine: why
        self.sessions_ready_total = 0
        self.sessions_lost_total = 0
        self.requests_failed_total = 0

    # ------------------------------------------------------------------ transport (subclass)

    @abc.abstractmethod
    def _send(self, session: int, msg: Any) -> None: ...

    @abc.abstractmethod
    def _pid(self) -> int: ...

    def _bind(self, events: EngineEvents) -> None:
        self._loop = asyncio.get_running_loop()
        self._events = events

    def _post(self, kind: str, session: int, payload: Any) -> None:
        """From the transport thread: handle this event on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._on_event, kind, session, payload)
        except RuntimeError:            # the loop is closed: the server is gone
            pass

    # ------------------------------------------------------------------ the contract

    def mark_gave_up(self, message: str) -> None:
        """On the loop: the supervisor gave up on the GPU worker; until an engine is ready again (an operator's
        restart), requests fail with EngineFailed, which tells the client not to retry here."""
        self.gave_up = self.last_error = message

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        if not self._session and self.gave_up is not None:
            raise EngineFailed(f"no engine serves here: {self.gave_up}")
        if not self._session:
            raise EngineUnavailable(f"the engine is not ready ({self.last_error}); it is being (re)started: retry "
                                    f"in a few seconds")
        rid = next(self._ids)
        self._send(self._session, em.AddRequest(rid, em.pack_token_ids(prompt_ids), params))
        self._in_flight[rid] = self._session
        return rid

    def abort(self, request_id: int) -> None:
        session = self._in_flight.pop(request_id, None)
        if session is not None:
            self._send(session, em.Abort([request_id]))

    def set_policy(self, policy: em.SetPolicy) -> None:
        self._policy = policy
        if self._session:
            self._send(self._session, policy)

    @property
    def stats(self) -> dict[str, float]:
        return {**self._stats, "link.sessions_ready_total": float(self.sessions_ready_total),
                "link.sessions_lost_total": float(self.sessions_lost_total),
                "link.requests_in_flight": float(len(self._in_flight))}

    def health(self) -> EngineHealth:
        return EngineHealth(self._session != 0, self.kind, self._pid() if self._session else 0, self.last_error)

    # ------------------------------------------------------------------ events (on the loop)

    def _on_event(self, kind: str, session: int, payload: Any) -> None:
        if kind == "ready":
            if session > self._session:
                self._adopt(session, payload)
        elif kind == "lost":
            self._on_lost(session, payload)
        elif kind == "gave_up":
            if not self._session:
                self.mark_gave_up(payload)
        elif kind == "msg":
            self._on_message(session, payload)

    def _adopt(self, session: int, facts: em.Ready | None) -> None:
        self._session = session
        self.facts = facts
        self.last_error = ""
        self.gave_up = None
        self.sessions_ready_total += 1
        if self._policy is not None:
            self._send(session, self._policy)

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
            self._events.on_request_failed(rid, error)
        self.requests_failed_total += len(failed)

    def _on_message(self, session: int, msg: Any) -> None:
        if isinstance(msg, em.TokenBatch):
            outputs = []
            for rid, token, finished, reason, logprobs in zip(msg.request_ids, msg.token_ids, msg.finished,
                                                              msg.finish_reasons, msg.logprobs()):
                if self._in_flight.get(rid) != session:
                    continue                      # aborted meanwhile
                if finished:
                    del self._in_flight[rid]
                outputs.append((rid, token, finished, reason or None, logprobs))
            if outputs:
                self._events.on_tokens(outputs)
        elif isinstance(msg, em.RequestFailed):
            if self._in_flight.get(msg.request_id) == session:
                del self._in_flight[msg.request_id]
                self.requests_failed_total += 1
                kind = EngineUnavailable if msg.retryable else EngineError   # draining / stopping: retry elsewhere
                self._events.on_request_failed(msg.request_id, kind(msg.message))
        elif isinstance(msg, em.Stats):
            if session == self._session:
                self._stats = dict(zip(msg.names, msg.values))
                self._events.on_stats(self.stats)
        elif isinstance(msg, em.Error):
            self.last_error = msg.message
        elif isinstance(msg, em.Drained):
            log.info("the engine drained: %d finished, %d aborted", msg.finished, msg.aborted)
