"""`ft serve` as a real process on 127.0.0.1: it answers, and SIGTERM drains (the stream in flight
finishes, new connections are refused) before it exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import http.client
from ftexpert.coordinator.ports import free_loopback_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")


_free_port = free_loopback_port


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"ft serve did not listen on {port} within {timeout_s} s")


def test_ft_serve_answers_and_drains_on_sigterm(tmp_path):
    port, grpc_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ftexpert.coordinator.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--grpc-port", str(grpc_port), "--max-context-tokens", "2048", "--drain-timeout-s", "90",
                             "--preset", "tiny", "--served-model-name", "tiny"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_listening(port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "stream": True, "ignore_eos": True,
             "temperature": 0}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)                     # drain starts while the stream runs
        time.sleep(0.5)
        try:                                                 # a new request is refused: 503 or no listener
            other = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            other.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}),
                          {"Content-Type": "application/json"})
            new_status = other.getresponse().status
        except OSError:
            new_status = None
        assert new_status in (503, None)
        body = first + resp.read()                           # the stream still runs to its end
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finishes[-1] == "length"
        assert proc.wait(120) == 0
        stderr = proc.stderr.read().decode()
        assert "drained: 1 finished, 0 aborted" in stderr, stderr[-2000:]
        assert "ft serve: stopped" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
