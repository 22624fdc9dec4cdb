"""`ft serve --attach` and `ft worker gpu` under a stand-in for systemd: a real AF_UNIX datagram socket per
unit as $NOTIFY_SOCKET, with a watchdog. READY=1 comes only when each can really serve (the coordinator: HTTP
listening and its GPU worker READY; the worker: model loaded and welcomed), STATUS= lines before, WATCHDOG=1
from then on, STOPPING=1 at the end; every message from the unit's main process only."""
from __future__ import annotations

import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_support import TINY_ARGS, Proc, Server  # noqa: E402


class NotifySocket:
    """What systemd listens on: datagrams with the sender's credentials (SO_PASSCRED)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.messages: list[tuple[float, int, str]] = []          # (when, sender pid, text)

    def env(self, watchdog_s: float = 2.0) -> dict:
        return {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}

    def poll(self, timeout_s: float = 0.1) -> None:
        self.sock.settimeout(timeout_s)
        try:
            while True:
                data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
                pid = next((struct.unpack("3i", d)[0] for level, kind, d in ancdata
                            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), -1)
                self.messages.append((time.monotonic(), pid, data.decode()))
                self.sock.settimeout(0.0)
        except (socket.timeout, BlockingIOError):
            pass

    def wait_for(self, text: str, timeout_s: float, proc: Proc) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            for when, _, message in self.messages:
                if text in message.split("\n"):
                    return when
            assert proc.popen.poll() is None, proc.output()[-3000:]
        raise AssertionError(f"no {text!r} within {timeout_s} s: {self.lines()}; output:\n{proc.output()[-3000:]}")

    def lines(self) -> list[str]:
        return [m for _, _, m in self.messages]

    def close(self) -> None:
        self.sock.close()


def test_ready_watchdog_and_status_for_the_coordinator_and_the_gpu_worker(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    addr = f"ipc://{run}/engine.sock"
    coord_notify, worker_notify = NotifySocket(str(tmp_path / "coord.notify")), NotifySocket(str(tmp_path / "w.notify"))
    srv = Server(["--attach", "--engine-addr", addr, "--worker-ready-timeout-s", "60", *TINY_ARGS],
                 tmp_path / "serve.log", grpc=False, env=coord_notify.env())
    worker = None
    try:
        coord_notify.wait_for("STATUS=waiting for the GPU worker to load and say READY", 60, srv)
        time.sleep(1.0)
        coord_notify.poll()
        assert not [m for m in coord_notify.lines() if "READY=1" in m]           # no worker yet: not ready
        worker = Proc(["worker", "gpu", "--engine-addr", addr], tmp_path / "worker.log",
                      env=worker_notify.env())
        worker_ready = worker_notify.wait_for("READY=1", 90, worker)
        ready = coord_notify.wait_for("READY=1", 30, srv)
        status, _ = srv.request("GET", "/health", timeout_s=5)
        assert status == 200                                                     # READY meant it: it serves
        assert srv.complete("Hello", 4)["choices"][0]["text"]
        statuses = [m for m in worker_notify.lines() if m.startswith("STATUS=")]
        assert statuses[0].startswith("STATUS=saying HELLO") and statuses[1].startswith("STATUS=loading the model")
        assert ready >= worker_ready
        time.sleep(2.0)                                                          # WatchdogSec 2 s: every 0.5 s
        for notify, proc in ((coord_notify, srv), (worker_notify, worker)):
            notify.poll()
            pings = [when for when, _, m in notify.messages if m == "WATCHDOG=1"]
            assert len(pings) >= 3, notify.lines()
            assert {pid for _, pid, _ in notify.messages} == {proc.pid}          # only the unit's main process
        assert srv.stop() == 0
        coord_notify.poll()
        assert any(m.startswith("STOPPING=1") for m in coord_notify.lines())
        assert worker.wait(20) == 0
        worker_notify.poll()
        assert any(m.startswith("STOPPING=1") for m in worker_notify.lines())
    finally:
        srv.kill()
        if worker is not None:
            worker.kill()
        coord_notify.close()
        worker_notify.close()
