"""Loopback port helpers shared by `ft`'s tests, the soak harness and local tools."""
from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
