"""Supervisor-side helpers: ``CpuWorkerProc`` (start/watch/stop one worker process) and ``ControlServer``
(the coordinator's ROUTER socket speaking proto.messages). Used by the coordinator and the tests.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from proto import messages as m

REPO_ROOT = Path(__file__).resolve().parents[1]


class CpuWorkerProc:
    """One `ft worker cpu` child process (python -m cpu_expert_pool.cli ...)."""

    def __init__(self, *, store_name: str, worker_index: int = 0, num_workers: int = 1,
                 channel_name: str | None = None, control_addr: str | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", "cpu_expert_pool.cli", "--store", store_name,
                     "--worker-index", str(worker_index), "--num-workers", str(num_workers),
                     "--parent-pid", str(os.getpid())]
        if channel_name:
            self.args += ["--channel", channel_name]
        if control_addr:
            self.args += ["--control", control_addr]
        self.args += list(extra_args)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), self.env.get("PYTHONPATH", "")]))
        self.popen: subprocess.Popen | None = None
        self._log_file = None

    def start(self) -> "CpuWorkerProc":
        self._log_file = open(self.log_path, "ab") if self.log_path else None
        self.popen = subprocess.Popen(self.args, cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                      stdout=self._log_file, stderr=subprocess.STDOUT if self._log_file else None)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, "start() first"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout_s: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after timeout_s. Returns the exit code."""
        if self.popen is None:
            return None
        if self.alive():
            self.signal(signal.SIGCONT)       # a stopped process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return self.popen.returncode


class ControlServer:
    """The coordinator's end of the control plane: a ROUTER socket; one identity per worker."""

    def __init__(self, addr: str):
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_s: float) -> tuple[bytes, m.Message]:
        if not self.sock.poll(int(timeout_s * 1000), self._zmq.POLLIN):
            raise TimeoutError(f"no control message within {timeout_s:.1f} s on {self.addr}")
        identity, *frames = self.sock.recv_multipart()
        return identity, m.decode(frames)

    def recv_type(self, cls: type, timeout_s: float) -> tuple[bytes, m.Message]:
        """The next message; raises if it is an Error or not of `cls`."""
        identity, msg = self.recv(timeout_s)
        if isinstance(msg, m.Error) and cls is not m.Error:
            raise RuntimeError(f"worker {msg.worker_index} reported an error: {msg.message}")
        if not isinstance(msg, cls):
            raise RuntimeError(f"expected {cls.__name__}, got {type(msg).__name__}")
        return identity, msg

    def send(self, identity: bytes, msg: m.Message) -> None:
        self.sock.send_multipart([identity, *m.encode(msg)])

    def handshake(self, config: m.Config, timeout_s: float,
                  expect_config_hash: str | None = None) -> tuple[bytes, m.Hello, m.Ready]:
        """HELLO -> CONFIG -> READY with one worker. A wrong config hash gets SHUTDOWN and an error."""
        deadline = time.monotonic() + timeout_s
        identity, hello = self.recv_type(m.Hello, timeout_s)
        if hello.protocol_version != m.PROTOCOL_VERSION:
            self.send(identity, m.Shutdown(f"protocol {hello.protocol_version} != {m.PROTOCOL_VERSION}"))
            raise RuntimeError(f"worker {hello.worker_index} speaks control protocol {hello.protocol_version}, "
                               f"this coordinator {m.PROTOCOL_VERSION}: run one build everywhere")
        if expect_config_hash is not None and hello.config_hash != expect_config_hash:
            self.send(identity, m.Shutdown("config hash mismatch"))
            raise RuntimeError(f"worker {hello.worker_index} sees store config hash {hello.config_hash!r}, "
                               f"expected {expect_config_hash!r}")
        self.send(identity, config)
        _, ready = self.recv_type(m.Ready, max(deadline - time.monotonic(), 0.001))
        return identity, hello, ready

    def close(self) -> None:
        self.sock.close()
