"""`RemoteEngine`: the EngineClient over the engine link to a GPU worker process (--workers process, --attach).

Sends (ADD_REQUEST, ABORT, SET_POLICY, SHUTDOWN) go from the event loop straight into the link's outbox
(LinkIO.send: a queue and a wake-up pipe, so they leave at once); what the link's IO thread learns
(ready / lost / messages) it hands to the loop with `call_soon_threadsafe` (EngineLinkServer.set_listener).
No thread of the coordinator waits on the worker. The message handling is LinkedEngineClient's.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from ftexpert.coordinator.engine_client import EngineEvents, LinkedEngineClient
from ftexpert.coordinator.engine_link import EngineLinkServer
from ftexpert.proto import engine_messages as em


class RemoteEngine(LinkedEngineClient):
    kind = "gpu-worker"

    def __init__(self, link: EngineLinkServer, *, restart_worker: Callable[[], None] | None = None):
        super().__init__()
        self.link = link
        self._restart_worker = restart_worker
        self.last_error = "no GPU worker has connected yet"

    async def start(self, events: EngineEvents) -> None:
        self._bind(events)
        self.link.set_listener(lambda event: self._post(*event))   # replays what came before (READY)
        await asyncio.sleep(0)                                      # ... handled before the first request

    def _send(self, session: int, msg: Any) -> None:
        self.link.send_to(session, msg)

    def _pid(self) -> int:
        return self.link.peer_pid

    async def restart(self) -> None:
        """The worker process is replaced (by its supervisor, else told to SHUTDOWN: systemd starts a new one);
        its requests fail when its session is lost."""
        if self._restart_worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._restart_worker)
        elif self._session:
            self.link.send_to(self._session, em.Shutdown("restart requested by an operator"))

    async def stop(self) -> None:
        self.link.set_listener(None)
