"""`ModelChild`: `ft worker store` run by the coordinator, the parent's end of proto/model_facts.py's link.

    child = ModelChild(spec, fill_store=True)
    facts = child.open()           # start it, OpenModel, wait for the model's facts
    ...                            # the owner creates the store from facts.store_shape and places its pages
    child.fill(store.name)         # FillStore, wait until it is filled and marked ready
    child.close()                  # wait for its exit (code 0); on an error path: child.kill()

This is how `ft serve` in process mode learns about its model without importing torch or the model-loading code:
the child does that, once, and exits. Its output (stdout and stderr) is forwarded to this process's stderr line
by line, and its last lines are kept. A child that fails (it answers Failed, exits, is killed, or runs past
`timeout_s` in one step, where one is set) raises `ModelChildFailed` naming its pid and its message, or its exit
and the tail of its output. It dies with this process (PR_SET_PDEATHSIG, --parent-pid); the store it fills is
this process's to unlink (the store's creator is its owner, coordinator/expert_resources.py).
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ftexpert.cpu_expert_pool.api import FT_COMMAND, IMPORT_ROOT, worker_env
from ftexpert.proto import model_facts as mf
from ftexpert.proto.engine_spec import EngineSpec

log = logging.getLogger("ft.coordinator.model_child")

TAIL_LINES = 20                  # of the child's output, quoted when it fails without saying why
EXIT_WAIT_S = 30.0               # after its last answer: how long it may take to exit
POLL_S = 0.5                     # how often a wait checks that the child still runs


class ModelChildFailed(RuntimeError):
    """`ft worker store` could not open the model or fill the store; the message says why (or quotes its output)."""


class ModelChild:
    def __init__(self, spec: EngineSpec, *, fill_store: bool, log_level: str = "INFO",
                 timeout_s: float | None = None):
        self.spec, self.fill_store, self.log_level, self.timeout_s = spec, fill_store, log_level, timeout_s
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def open(self) -> mf.ModelFacts:
        """Start `ft worker store` and return the facts of the model the spec names."""
        parent_end, child_end = socket.socketpair()
        argv = [*FT_COMMAND, "worker", "store", "--link-fd", str(child_end.fileno()), "--parent-pid",
                str(os.getpid()), "--log-level", self.log_level]
        try:
            self.proc = subprocess.Popen(argv, cwd=IMPORT_ROOT, env=worker_env(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         pass_fds=(child_end.fileno(),))
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()                    # the child's now: its exit closes the link (EOF here)
        self.conn = Connection(parent_end.detach())
        self._reader = threading.Thread(target=self._forward_output, name="ft-model-child-output", daemon=True)
        self._reader.start()
        log.info("opening the model in `ft worker store` (pid %d)", self.proc.pid)
        self._send(mf.OpenModel(self.spec, self.fill_store))
        return self._expect(mf.ModelFacts, "open the model")

    def fill(self, store_name: str) -> float:
        """Have the child fill the store `store_name` (created for the facts open() returned); its seconds."""
        self._send(mf.FillStore(store_name))
        return self._expect(mf.StoreFilled, f"fill the expert store {store_name!r}").seconds

    def close(self) -> None:
        """After its last answer: wait for its exit, which must be clean."""
        if self.proc is None:
            return
        try:
            code = self.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ModelChildFailed(f"`ft worker store` (pid {self.pid}) did not exit within {EXIT_WAIT_S:g} s of "
                                   f"its last answer; it was killed{self._quoted_tail()}") from None
        self._finish()
        if code != 0:
            raise ModelChildFailed(f"`ft worker store` (pid {self.pid}) {self._exit_text(code)} after its last "
                                   f"answer{self._quoted_tail()}")

    def kill(self) -> None:
        """Stop it now (an error path: this process gives up, or is interrupted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:            # pragma: no cover - SIGKILL does not wait on us
                log.error("`ft worker store` (pid %d) outlived SIGKILL", self.pid)
        self._finish()

    # ------------------------------------------------------------------ inside

    def _send(self, message: Any) -> None:
        assert self.conn is not None, "open() first"
        try:
            self.conn.send_bytes(mf.encode(message))
        except OSError:
            raise self._exited(f"take {type(message).__name__}") from None

    def _expect(self, cls: type, what: str) -> Any:
        assert self.conn is not None and self.proc is not None
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while not self.conn.poll(POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                self.kill()
                raise ModelChildFailed(f"`ft worker store` (pid {self.pid}) did not {what} within "
                                       f"{self.timeout_s:g} s; it was killed{self._quoted_tail()}")
        try:
            message = mf.decode(self.conn.recv_bytes(mf.MAX_FRAME_BYTES))
        except (EOFError, OSError):
            raise self._exited(what) from None
        if isinstance(message, mf.Failed):
            self._wait_for_exit()                     # it exits at once; its last log lines come first
            raise ModelChildFailed(f"`ft worker store` (pid {self.pid}) could not {what}: {message.error}")
        if not isinstance(message, cls):
            raise ModelChildFailed(f"`ft worker store` (pid {self.pid}) answered {type(message).__name__} where "
                                   f"{cls.__name__} was due: it runs another version of this code")
        return message

    def _wait_for_exit(self) -> int | None:
        assert self.proc is not None
        try:
            self.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._finish()
        return self.proc.returncode

    def _exited(self, what: str) -> ModelChildFailed:
        """The link closed: the child is gone (or going) without saying why."""
        code = self._wait_for_exit()
        return ModelChildFailed(f"`ft worker store` (pid {self.pid}) {self._exit_text(code)} before it could "
                                f"{what}{self._quoted_tail()}")

    @staticmethod
    def _exit_text(code: int | None) -> str:
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def _quoted_tail(self) -> str:
        lines = [ln.rstrip("\n") for ln in self.tail]
        return ("; its last output:\n    " + "\n    ".join(lines)) if lines else " (it printed nothing)"

    def _forward_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):            # our stderr closed: keep collecting the tail
                pass

    def _finish(self) -> None:
        """After its exit: its output read to the end, the link closed."""
        if self._reader is not None:
            self._reader.join(5.0)
            self._reader = None
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
