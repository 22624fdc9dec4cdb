"""The child's side of the supervisor link (coordinator/supervisor.py has the parent's side): a contract shared by
the coordinator and every process it supervises (the GPU worker, the CPU expert workers).

A supervised child inherits one end of a socket pair; its number is in $FT_SUPERVISOR_FD. Frames are
length-prefixed msgpack maps (multiprocessing.connection's send_bytes/recv_bytes framing; no pickle):

    child  -> parent   {"type": "hello", "name", "pid", "config_hash", "protocol"}
    parent -> child    {"type": "welcome"}  or  {"type": "reject", "reason"}
    child  -> parent   {"type": "ready"}                 (after its big allocations)
    child  -> parent   {"type": "heartbeat"}             (every heartbeat interval)
    parent -> child    {"type": "shutdown"}              (exit soon, cleanly)

A child whose parent goes away sees end-of-file on the link and exits (die with the parent).

    link = SupervisorLink.from_env()
    link.hello(config_hash(my_config))   # raises HandshakeRejected on a config mismatch
    ... allocate, load ...
    link.ready()
    link.serve(heartbeat_interval_s=1.0)  # heartbeats until the parent says shutdown (or is gone)
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
ENV_FD = "FT_SUPERVISOR_FD"
ENV_NAME = "FT_WORKER_NAME"
HELLO, WELCOME, REJECT, READY, HEARTBEAT, SHUTDOWN = "hello", "welcome", "reject", "ready", "heartbeat", "shutdown"
MAX_FRAME_BYTES = 1 << 20


def config_hash(config: Any) -> str:
    """A short, stable hash of a JSON-able config (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def encode(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(frame: bytes) -> dict[str, Any]:
    message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError(f"malformed supervisor frame: {frame[:64]!r}")
    return message


class HandshakeRejected(RuntimeError):
    """The supervisor refused this child (config hash mismatch, unknown name)."""


class SupervisorLink:
    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.name = name
        self._send_lock = threading.Lock()
        self.shutdown_requested = threading.Event()

    @classmethod
    def from_env(cls) -> "SupervisorLink":
        if ENV_FD not in os.environ:
            raise RuntimeError(f"${ENV_FD} is not set: this process must be started by the coordinator's "
                               f"supervisor (or run it standalone without a link)")
        return cls(Connection(int(os.environ[ENV_FD])), os.environ.get(ENV_NAME, f"pid{os.getpid()}"))

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.conn.send_bytes(encode(message))

    def hello(self, config_hash_value: str, timeout_s: float = 30.0) -> None:
        self.send({"type": HELLO, "name": self.name, "pid": os.getpid(), "config_hash": config_hash_value,
                   "protocol": PROTOCOL_VERSION})
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.name}: the supervisor did not answer HELLO within {timeout_s} s")
        reply = decode(self.conn.recv_bytes(MAX_FRAME_BYTES))
        if reply["type"] == REJECT:
            raise HandshakeRejected(f"worker {self.name} rejected by the supervisor: {reply.get('reason')}")
        if reply["type"] != WELCOME:
            raise RuntimeError(f"worker {self.name}: expected WELCOME, got {reply['type']!r}")

    def ready(self) -> None:
        self.send({"type": READY})

    def serve(self, heartbeat_interval_s: float = 1.0, max_s: float | None = None) -> None:
        """Send heartbeats until SHUTDOWN arrives, the parent is gone, or max_s passes."""
        listener = threading.Thread(target=self._listen, name="ft-supervisor-link", daemon=True)
        listener.start()
        waited = 0.0
        while not self.shutdown_requested.wait(heartbeat_interval_s):
            try:
                self.send({"type": HEARTBEAT})
            except OSError:
                return              # parent gone
            waited += heartbeat_interval_s
            if max_s is not None and waited >= max_s:
                return

    def start_background(self, heartbeat_interval_s: float = 1.0) -> threading.Thread:
        """Heartbeats from a daemon thread (for children whose main thread does the work)."""
        t = threading.Thread(target=self.serve, args=(heartbeat_interval_s,), name="ft-heartbeat", daemon=True)
        t.start()
        return t

    def _listen(self) -> None:
        while True:
            try:
                message = decode(self.conn.recv_bytes(MAX_FRAME_BYTES))
            except (EOFError, OSError):
                self.shutdown_requested.set()      # parent gone: die with it
                return
            except ValueError:
                continue
            if message["type"] == SHUTDOWN:
                self.shutdown_requested.set()
                return
