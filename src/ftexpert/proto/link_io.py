"""`LinkIO`: the IO thread at either end of a ZMQ link (the engine link's ROUTER and DEALER).

The thread owns the socket (ZMQ sockets are not thread-safe); other threads never touch it. They call
`send(item)`, which queues the item and writes one byte to a wake-up pipe that the IO thread polls next
to the socket, so a send leaves at once instead of at the next poll tick. Received frames and ticks are
handled by the subclass in the IO thread (`on_frames`, `on_tick`, `on_fd`); what it learns goes to
whoever consumes it through plain queues. Busy loops therefore never see a socket.

Addresses are local only: ``ipc://PATH`` (the default, in a private directory) or ``tcp://127.0.0.1:PORT``
(or ``localhost`` / ``[::1]``). Peers authenticate in the handshake (proto/link_auth.py); the traffic itself
is not encrypted, so it never leaves the host.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import zmq

log = logging.getLogger("ft.link")

POLL_TICK_S = 0.1                 # longest the IO thread sleeps without calling on_tick
MAX_FRAMES_PER_TICK = 1000        # received messages handled before the outbox is looked at again
LINGER_MS = 500                   # how long unsent messages may delay closing the socket
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def check_loopback_address(addr: str, flag: str = "--engine-addr") -> str:
    """Refuse anything but loopback TCP or ipc:// (the link's traffic is not encrypted)."""
    if addr.startswith("ipc://") and len(addr) > len("ipc://"):
        return addr
    if addr.startswith("tcp://"):
        host = addr[len("tcp://"):].rsplit(":", 1)[0]
        if host in LOOPBACK_HOSTS:
            return addr
    raise ValueError(f"{flag} {addr!r} is not a loopback address; use ipc:///run/ft/engine.sock or "
                     f"tcp://127.0.0.1:PORT (the engine link's traffic is not encrypted, so it never leaves the host)")


class LinkIO(threading.Thread):
    """Subclasses create `self.sock` before start() and implement the on_* hooks."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock: Any = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop_event = threading.Event()
        self._poller = zmq.Poller()
        self._fds: set[int] = set()
        self.dropped_total = 0            # messages the socket refused (peer gone, queue full)

    # ------------------------------------------------------------------ any thread

    def send(self, item: Any) -> None:
        self._outbox.put(item)
        self._wake()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop_event.set()
        self._wake()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):   # pipe full (a wake-up is pending anyway) or closed
            pass

    # ------------------------------------------------------------------ IO thread

    def watch_fd(self, fd: int) -> None:
        self._poller.register(fd, self.zmq.POLLIN)
        self._fds.add(fd)

    def unwatch_fd(self, fd: int) -> None:
        if fd in self._fds:
            self._poller.unregister(fd)
            self._fds.discard(fd)

    def send_frames(self, frames: list[bytes]) -> bool:
        try:
            self.sock.send_multipart(frames, flags=self.zmq.NOBLOCK)
            return True
        except self.zmq.Again:
            self.dropped_total += 1
            return False

    def run(self) -> None:
        zmq = self.zmq
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                events = dict(self._poller.poll(int(POLL_TICK_S * 1000)))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                self._flush_outbox()
                if self.sock in events:
                    for _ in range(MAX_FRAMES_PER_TICK):
                        try:
                            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.on_frames(frames)
                for fd in [fd for fd in self._fds if fd in events]:
                    self.on_fd(fd)
                self.on_tick(time.monotonic())
            self._flush_outbox()                      # last words (SHUTDOWN) before closing
        except Exception:  # noqa: BLE001 - the link is dead; consumers learn it through on_closed
            log.exception("%s: IO thread failed", self.name)
        finally:
            self.on_closed()
            self.sock.close(LINGER_MS)
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _flush_outbox(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            frames = self.frames_for(item)
            if frames is not None:
                self.send_frames(frames)

    # ------------------------------------------------------------------ hooks

    def frames_for(self, item: Any) -> list[bytes] | None:
        """Turn an outbox item into frames (None: drop it)."""
        return item

    def on_frames(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def on_fd(self, fd: int) -> None:
        pass

    def on_tick(self, now: float) -> None:
        pass

    def on_closed(self) -> None:
        pass
