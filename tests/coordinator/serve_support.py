"""Helpers for tests that run `ft serve` / `ft worker gpu` as real processes on 127.0.0.1: start with free
ports and a log file, wait until listening, read answers with http.client, stop with SIGTERM (kill on
timeout). Every wait is bounded."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from ftexpert.coordinator.ports import free_loopback_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
FT = [sys.executable, "-m", "ftexpert.coordinator.cli"]
TINY_ARGS = ["--preset", "tiny", "--device", "cpu", "--max-context-tokens", "512", "--max-running-requests", "4"]


free_port = free_loopback_port


class Proc:
    """One ft process with its output in a file (`command`: what runs `args`, by default the `ft` command)."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, command: list[str] = FT):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(command + args, cwd=REPO, env={**ENV, **(env or {})}, stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ft {' '.join(self.args[:2])} did not exit within {timeout_s} s; its output:\n"
                                 f"{self.output()[-3000:]}") from None

    def wait_for_output(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} did not appear within {timeout_s} s; output:\n{self.output()[-3000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        code = self.wait(timeout_s)
        self._log.close()
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self._log.close()


class Server(Proc):
    """`ft serve` on free loopback ports (the tests' model, `--preset tiny`, unless `extra` names one or
    `default_model` asks for the embedded default; it is served as "tiny" either way)."""

    def __init__(self, extra: list[str], log_path: Path, *, grpc: bool = True, env: dict | None = None,
                 command: list[str] = FT, default_model: bool = False):
        self.port = free_port()
        self.grpc_port = free_port() if grpc else -1
        model = [] if {"--model", "--preset"} & set(extra) or default_model else ["--preset", "tiny"]
        super().__init__(["serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port), *model,
                          "--served-model-name", "tiny", "--drain-timeout-s", "5", *extra], log_path, env, command)

    def wait_listening(self, timeout_s: float = 90.0) -> "Server":
        self.wait_for_output("ft serve: tiny", timeout_s)
        return self

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float = 60.0):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()

    def complete(self, prompt: str = "Hello", max_tokens: int = 24, **extra) -> dict:
        status, body = self.request("POST", "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                               "max_tokens": max_tokens, "temperature": 0, **extra})
        assert status == 200, body
        return body

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                status, last = self.request("GET", "/health", timeout_s=5)
                if status == 200:
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise AssertionError(f"/health not ok within {timeout_s} s (last: {last}); output:\n{self.output()[-3000:]}")


def children_pids(pid: int, needle: str) -> list[int]:
    """Pids of processes whose parent is `pid` and whose command line contains `needle`."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children() if needle in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
