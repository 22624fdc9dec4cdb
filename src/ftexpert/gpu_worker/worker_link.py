"""The GPU worker's end of the engine link: `CoordinatorLink`, an IO thread around a DEALER socket.

Frames from the coordinator become messages in the worker's inbox (heartbeats are consumed here);
`send(msg)` from the busy loop leaves at once (proto/link_io.py). After WELCOME the thread sends a
heartbeat whenever nothing else went out for heartbeat_interval_s (also while the model loads), and
puts one `CoordinatorLost` in the inbox when the coordinator has been silent for peer_timeout_s, or at once
when the pid WELCOME named exits (a pidfd: the link is local): nobody else may bind the address and go on
talking to this worker after the coordinator it authenticated is gone.
"""
from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass

from ftexpert.proto import engine_messages as em
from ftexpert.proto.link_io import LinkIO, check_loopback_address

log = logging.getLogger("ft.gpu_worker.link")


@dataclass(frozen=True)
class CoordinatorLost:
    reason: str


@dataclass(frozen=True)
class _WatchPid:
    pid: int


class CoordinatorLink(LinkIO):
    def __init__(self, addr: str, identity: bytes, inbox: queue.SimpleQueue):
        super().__init__("ft-engine-link")
        check_loopback_address(addr)
        self.addr = addr
        self.identity = identity
        self.inbox = inbox
        self._pidfd: int | None = None
        zmq = self.zmq
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.heartbeat_interval_s: float | None = None      # set by WELCOME
        self.peer_timeout_s: float | None = None
        self.last_rx = time.monotonic()
        self.last_tx = 0.0
        self._lost_reported = False

    def watch_coordinator(self, pid: int) -> None:
        """From now on the exit of `pid` (the authenticated coordinator) is a CoordinatorLost at once."""
        self.send(_WatchPid(pid))

    def frames_for(self, msg) -> list[bytes] | None:
        if isinstance(msg, _WatchPid):              # in the IO thread, which owns the poller
            try:
                self._pidfd = os.pidfd_open(msg.pid)
                self.watch_fd(self._pidfd)
            except (AttributeError, OSError):       # not Linux, or the pid is gone already: silence still tells
                pass
            return None
        self.last_tx = time.monotonic()
        return em.encode(msg)

    def on_fd(self, fd: int) -> None:
        if fd == self._pidfd:
            self.unwatch_fd(fd)
            self._report_lost(f"the coordinator at {self.addr} exited")

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = em.decode(frames)
        except em.MessageError as exc:
            log.warning("dropping a malformed message from the coordinator: %s", exc)
            return
        self.last_rx = time.monotonic()
        if isinstance(msg, em.Heartbeat):
            return
        if isinstance(msg, em.Welcome):
            self.heartbeat_interval_s = msg.heartbeat_interval_s
            self.peer_timeout_s = msg.peer_timeout_s
        self.inbox.put(msg)

    def on_tick(self, now: float) -> None:
        if self.heartbeat_interval_s is None:
            return
        if now - self.last_tx >= self.heartbeat_interval_s:
            self.last_tx = now
            self.send_frames(em.encode(em.Heartbeat()))
        if now - self.last_rx > self.peer_timeout_s:
            self._report_lost(f"the coordinator at {self.addr} sent nothing for {now - self.last_rx:.1f} s")

    def _report_lost(self, reason: str) -> None:
        if not self._lost_reported:
            self._lost_reported = True
            self.inbox.put(CoordinatorLost(reason))

    def on_closed(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
