"""proto/sd_notify.py against a real AF_UNIX datagram socket (a path and an abstract '@' name): READY, STATUS,
STOPPING, the watchdog's pace and WATCHDOG_PID, and the variables taken out of the environment."""
from __future__ import annotations

import os
import socket

import pytest

from ftexpert.proto.sd_notify import Notifier


def receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(2.0)
    return sock


def received(sock: socket.socket) -> list[str]:
    out = []
    sock.settimeout(0.05)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except (socket.timeout, BlockingIOError):
        return out


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_messages_reach_the_notify_socket(tmp_path, kind):
    address = str(tmp_path / "notify") if kind == "path" else f"@ft-test-notify-{os.getpid()}"
    sock = receiver(address)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": address})
        assert n.enabled and n.watchdog_interval_s is None
        assert n.status("loading")
        assert not n.status("loading")                   # unchanged: not sent again
        assert n.ready("serving on http://127.0.0.1:1919")
        assert not n.watchdog()                          # no WatchdogSec: nothing to feed
        assert n.stopping()
        assert received(sock) == ["STATUS=loading", "READY=1\nSTATUS=serving on http://127.0.0.1:1919",
                                  "STOPPING=1\nSTATUS=stopping"]
        n.close()
    finally:
        sock.close()


def test_the_watchdog_is_paced_and_only_for_its_pid(tmp_path):
    address = str(tmp_path / "notify")
    sock = receiver(address)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
        assert n.watchdog_interval_s == 2.0
        sent = [n.watchdog(now=t) for t in (100.0, 100.2, 100.49, 100.5, 101.0)]
        assert sent == [True, False, False, True, True]  # every WatchdogSec / 4 at most
        assert received(sock) == ["WATCHDOG=1"] * 3
        other = Notifier.from_env({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"})
        assert other.watchdog_interval_s is None and not other.watchdog()
    finally:
        sock.close()


def test_without_systemd_nothing_is_sent_and_a_dead_socket_does_not_raise(tmp_path):
    assert not Notifier.from_env({}).ready("x") and not Notifier.from_env({}).enabled
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert n.enabled and not n.ready()                   # delivery failed, quietly


def test_unset_takes_the_variables_out_of_the_environment():
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": str(os.getpid()), "OTHER": "1"}
    n = Notifier.from_env(env, unset=True)
    assert n.address == "@x" and n.watchdog_interval_s == 0.001 and env == {"OTHER": "1"}
