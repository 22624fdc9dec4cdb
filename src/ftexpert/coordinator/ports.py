"""Port helpers: free loopback ports (`ft`'s tests, the soak harness, local tools) and the listen-address
check `ft serve` runs before it loads anything."""
from __future__ import annotations

import errno
import socket

LOOPBACK = "127.0.0.1"


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def check_listen_addresses(addresses: list[tuple[str, str, int, str]]) -> None:
    """Fail fast, before anything loads, when one of (what, host, port, flag) cannot be listened on.

    Binds each as the server will (SO_REUSEADDR) and closes it at once; port 0 (any free port) always works. The
    error names the address, what it is for, and the flag that moves it."""
    for what, host, port, flag in addresses:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                s.listen(1)
            except OSError as exc:
                where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
                hint = (f"another process listens there (`ss -ltnp 'sport = :{port}'` shows which): stop it or "
                        f"pick another {flag}") if exc.errno == errno.EADDRINUSE else f"check {flag}"
                raise RuntimeError(f"cannot listen for {what} on {where}: {exc.strerror}; {hint}") from None
