"""`InlineEngine`: the EngineClient of `ft serve --workers inline`: the GPU worker's own loop
(gpu_worker/worker_loop.py `gpu_busy_loop`) in a thread of this process, spoken to with the engine link's
messages. Only the transport differs from RemoteEngine: messages go in through the loop's inbox (a queue),
and what the loop sends comes back to the event loop through `call_soon_threadsafe`, unencoded.

`engine_factory()` builds the engine in that thread (start, and RestartWorker "engine"); each engine is
one session, so a restart fails the old engine's requests and leaves the new one's alone.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from typing import Any, Callable

from ftexpert.coordinator.engine_client import EngineEvents, LinkedEngineClient
from ftexpert.gpu_worker.api import gpu_busy_loop
from ftexpert.proto import engine_messages as em

log = logging.getLogger("ft.coordinator.inline_engine")

STOP_TIMEOUT_S = 30.0


class InlineEngine(LinkedEngineClient):
    kind = "in-process"

    def __init__(self, engine_factory: Callable[[], Any], *, start_timeout_s: float = 600.0):
        super().__init__()
        self._factory = engine_factory
        self._start_timeout_s = start_timeout_s
        self._sessions = itertools.count(1)
        self._inbox: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    async def start(self, events: EngineEvents) -> None:
        self._bind(events)
        await self._launch()

    def _send(self, session: int, msg: Any) -> None:
        if session == self._session and self._inbox is not None:
            self._inbox.put(msg)

    def _pid(self) -> int:
        return os.getpid()

    async def restart(self) -> None:
        await self._shut_down("restart requested by an operator")
        await self._launch()

    async def stop(self) -> None:
        await self._shut_down("the server is stopping")

    # ------------------------------------------------------------------ the engine thread

    async def _launch(self) -> None:
        session = next(self._sessions)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        built: asyncio.Future = self._loop.create_future()
        self._inbox = inbox
        self._thread = threading.Thread(target=self._run, args=(session, inbox, built), name="ft-engine",
                                        daemon=True)
        self._thread.start()
        await asyncio.wait_for(built, self._start_timeout_s)
        self._on_event("ready", session, None)

    async def _shut_down(self, reason: str) -> None:
        thread, inbox = self._thread, self._inbox
        if thread is None or inbox is None:
            return
        inbox.put(em.Shutdown(reason))
        await asyncio.get_running_loop().run_in_executor(None, thread.join, STOP_TIMEOUT_S)
        if thread.is_alive():
            log.error("the engine thread did not stop within %.0f s", STOP_TIMEOUT_S)
        self._thread = self._inbox = None

    def _run(self, session: int, inbox: queue.SimpleQueue, built: asyncio.Future) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported to whoever awaits start / restart
            log.exception("the engine failed to start")
            self._loop.call_soon_threadsafe(_fail, built, RuntimeError(f"the engine failed to start: {exc}"))
            return
        self._loop.call_soon_threadsafe(_succeed, built)
        reason, failed = "the in-process engine stopped", False
        try:
            code = gpu_busy_loop(engine, inbox, lambda msg: self._post("msg", session, msg))
            if code:
                reason, failed = f"the in-process engine stopped (exit code {code}: its steps kept failing)", True
        except BaseException as exc:  # noqa: BLE001 - the loop died; its requests fail
            log.exception("the engine loop died")
            reason, failed = f"the engine loop died ({type(exc).__name__}: {exc}); see the server log", True
        self._post("lost", session, reason)
        if failed:                     # nothing restarts an inline engine by itself
            log.error("%s; it stays stopped until `ft ctl restart engine`", reason)
            self._post("gave_up", session, f"{reason}; it stays stopped until an operator restarts it "
                                           f"(`ft ctl restart engine`)")


def _succeed(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
