"""The systemd notification protocol (sd_notify(3)) in a few lines: datagrams to $NOTIFY_SOCKET.

    notifier = Notifier.from_env()          # a no-op when systemd did not ask (no $NOTIFY_SOCKET)
    notifier.status("loading the model")
    notifier.ready("serving on ...")        # READY=1 only once the process can really serve
    notifier.watchdog()                     # from the busy loop; sends at most every WatchdogSec / 4
    notifier.stopping()

Units are `Type=notify` with `WatchdogSec=` (deploy/): `WATCHDOG=1` is sent from each process's busy loop,
never from a thread of its own, so a hung loop stops it and systemd restarts the process. $NOTIFY_SOCKET
is a path or, starting with '@', an abstract socket name. Sends never raise: a notification that cannot be
delivered must not take the service down.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

log = logging.getLogger("ft.sd_notify")

WATCHDOG_SEND_FRACTION = 0.25          # send WATCHDOG=1 every WatchdogSec / 4 (systemd suggests half or less)


class Notifier:
    def __init__(self, address: str | None, watchdog_interval_s: float | None = None):
        self.address = address
        self.watchdog_interval_s = watchdog_interval_s       # WatchdogSec (None: no watchdog asked for)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._last_watchdog = 0.0
        self.status_text = ""

    @classmethod
    def from_env(cls, environ=None, *, unset: bool = False) -> "Notifier":
        """unset: remove the variables (sd_notify's unset_environment), so that children do not notify as us."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        interval = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and (not pid or pid == str(os.getpid())):
            try:
                interval = int(usec) / 1e6 or None
            except ValueError:
                interval = None
        if unset:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(name, None)
        return cls(address, interval)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send 'KEY=VALUE' lines as one datagram; False when not enabled or not delivered."""
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        data = "\n".join(assignments).encode("utf-8", "replace")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(data, target)
                return True
            except OSError as exc:
                log.debug("sd_notify to %s failed: %s", self.address, exc)
                return False

    def ready(self, status: str = "") -> bool:
        self.status_text = status or self.status_text
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """STATUS=text, sent only when it changes."""
        if text == self.status_text:
            return False
        self.status_text = text
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str = "stopping") -> bool:
        self.status_text = status
        return self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self, now: float | None = None) -> bool:
        """WATCHDOG=1 when due (every WatchdogSec / 4); cheap to call on every turn of a busy loop."""
        if self.watchdog_interval_s is None or self.address is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_watchdog < self.watchdog_interval_s * WATCHDOG_SEND_FRACTION:
            return False
        self._last_watchdog = now
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


_PROCESS_NOTIFIER: Notifier | None = None


def process_notifier() -> Notifier:
    """This process's notifier, made from the environment once (which loses the variables: the processes this
    one starts are not the unit's main process and must not say READY for it)."""
    global _PROCESS_NOTIFIER
    if _PROCESS_NOTIFIER is None:
        _PROCESS_NOTIFIER = Notifier.from_env(unset=True)
    return _PROCESS_NOTIFIER
