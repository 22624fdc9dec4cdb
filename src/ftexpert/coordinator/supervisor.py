"""Child-process supervision for the GPU worker and the CPU expert workers.

    sup = Supervisor([WorkerSpec("cpu0", cpu_expert_pool.api.worker_argv(store_name=..., channel_name=...),
                                 config_hash=config_hash(cfg))], on_error=report)
    sup.start()          # every child HELLO (config hash checked) + READY, or one typed error, fast
    ...
    sup.check()          # raises the first WorkerError not yet seen by a caller
    sup.stop()

One monitor thread waits (multiprocessing.connection.wait) on every child's process sentinel
(a pidfd), its link, and a wake-up pipe. A child that exits, or stops sending heartbeats, becomes one
WorkerError (to `on_error` and to `check()`); it is then restarted after an exponential back-off,
until `max_restarts` failures in a row mark it failed: then one WorkerGaveUp goes to `on_error` and
the log (error level); its message ends with the owner's `give_up_advice` (what brings the worker back in
that owner's mode). A child READY for `stable_after_s` without failing starts the count (and the
back-off) afresh: the period runs from this child's READY, never from an earlier child's. Children are plain
subprocesses (no multiprocessing pickling); the link protocol is in proto/supervised_child.py (the child's
side).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from ftexpert.proto.supervised_child import (ENV_FD, ENV_NAME, HEARTBEAT, HELLO, MAX_FRAME_BYTES, PROTOCOL_VERSION,
                                          READY, REJECT, SHUTDOWN, WELCOME, decode, encode)

log = logging.getLogger("ft.coordinator.supervisor")

MONITOR_TICK_S = 0.25            # longest the monitor sleeps without looking at deadlines
DEFAULT_GIVE_UP_ADVICE = "then restart the program that started it"
EXIT_WORKERS_GAVE_UP = 70        # EX_SOFTWARE: `ft serve --on-worker-give-up exit` once a worker is given up on
STOP_GRACE_S = 3.0               # SHUTDOWN -> SIGTERM -> SIGKILL steps


class WorkerError(RuntimeError):
    """A supervised worker failed. Subclasses say how; every message names the worker and a fix."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


class WorkerExited(WorkerError):
    def __init__(self, name: str, exitcode: int | None, phase: str, stderr_tail: str = ""):
        how = f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}"
        tail = f"; its last output: {stderr_tail.strip()[-500:]}" if stderr_tail.strip() else ""
        super().__init__(name, f"worker {name} {how} {phase}{tail}")
        self.exitcode, self.phase = exitcode, phase


class HandshakeTimeout(WorkerError):
    pass


class ConfigMismatch(WorkerError):
    pass


class HeartbeatTimeout(WorkerError):
    pass


class WorkerGaveUp(WorkerError):
    pass


@dataclass
class WorkerSpec:
    name: str
    argv: list[str]
    config_hash: str
    env: dict[str, str] | None = None          # added to the parent's environment
    ready_timeout_s: float = 60.0               # start -> READY
    heartbeat_timeout_s: float = 10.0           # 0 = no heartbeat check
    restart: bool = True
    max_restarts: int = 5                       # failures in a row before giving up
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0                # READY this long resets the failure count
    kind: str = "worker"


@dataclass
class _Worker:
    spec: WorkerSpec
    state: str = "stopped"             # starting | handshaking | ready | backoff | failed | stopped
    popen: subprocess.Popen | None = None
    conn: Connection | None = None
    sentinel: int | None = None         # pidfd
    deadline: float = 0.0               # READY deadline while starting, restart time while in backoff
    last_heartbeat: float = 0.0
    ready_at: float = 0.0
    started_at: float = 0.0
    restarts: int = 0
    failures_in_row: int = 0
    last_error: str = ""
    ready_event: threading.Event = field(default_factory=threading.Event)
    start_error: WorkerError | None = None
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=40))
    pid: int = 0
    generation: int = 0                 # bumped by every spawn: stale wake-ups of an old child are ignored


class Supervisor:
    def __init__(self, specs: list[WorkerSpec], on_error: Callable[[WorkerError], None] | None = None,
                 give_up_advice: Callable[[str], str] | None = None):
        """give_up_advice(name): how to bring worker `name` back once this supervisor gave up on it (its owner
        knows: `ft ctl restart NAME` where the coordinator keeps serving, a restart of the service where it exits)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        self._workers = {s.name: _Worker(s) for s in specs}
        self._on_error = on_error
        self._give_up_advice = give_up_advice or (lambda name: DEFAULT_GIVE_UP_ADVICE)
        self._errors: deque[WorkerError] = deque()
        self._lock = threading.RLock()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------------ public

    def start(self, timeout_s: float | None = None) -> None:
        """Start every child and wait for all READY; raises the first WorkerError (and stops the rest)."""
        with self._lock:
            for w in self._workers.values():
                self._spawn(w)
        self._monitor = threading.Thread(target=self._monitor_loop, name="ft-supervisor", daemon=True)
        self._monitor.start()
        longest = max((w.spec.ready_timeout_s for w in self._workers.values()), default=0.0)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else longest + 5.0)
        for w in self._workers.values():
            if not w.ready_event.wait(max(0.0, deadline - time.monotonic())):
                err = HandshakeTimeout(w.spec.name, f"worker {w.spec.name} did not become READY in time")
                self.stop()
                raise err
            if w.start_error is not None:
                err = w.start_error
                self.stop()
                raise err
        with self._lock:   # errors of the start itself were raised above; callers start clean
            self._errors.clear()

    def check(self) -> None:
        """Raise the oldest worker error not yet raised (one typed error per failure)."""
        with self._lock:
            if self._errors:
                raise self._errors.popleft()

    def restart(self, name: str) -> None:
        """Operator restart: stop the child now and start it again at once (no back-off)."""
        with self._lock:
            if name not in self._workers:
                raise ValueError(f"no worker named {name!r}; workers: {', '.join(self._workers)}")
            w = self._workers[name]
            self._terminate(w, "restart requested by an operator")
            w.restarts += 1
            w.failures_in_row = 0
            self._spawn(w)
        self._wake()

    def worker_info(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return [{"name": w.spec.name, "kind": w.spec.kind, "state": w.state, "pid": w.pid,
                     "restarts": w.restarts, "uptime_s": now - w.ready_at if w.state == "ready" else 0.0,
                     "last_heartbeat_age_s": now - w.last_heartbeat if w.last_heartbeat else -1.0,
                     "last_error": w.last_error} for w in self._workers.values()]

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        with self._lock:
            self._stopping = True
            for w in self._workers.values():
                if w.conn is not None:
                    try:
                        w.conn.send_bytes(encode({"type": SHUTDOWN}))
                    except OSError:
                        pass
        deadline = time.monotonic() + timeout_s
        for w in self._workers.values():
            if w.popen is not None:
                try:
                    w.popen.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        with self._lock:
            for w in self._workers.values():
                self._terminate(w, None)
                w.state = "stopped"
        self._wake()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout_s + 1.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ child lifecycle (lock held)

    def _spawn(self, w: _Worker) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env.update(w.spec.env or {})
        env[ENV_FD] = str(child_sock.fileno())
        env[ENV_NAME] = w.spec.name
        try:
            w.popen = subprocess.Popen(w.spec.argv, env=env, pass_fds=(child_sock.fileno(),),
                                       stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=False)
        except OSError as exc:
            parent_sock.close()
            child_sock.close()
            raise WorkerError(w.spec.name, f"cannot start worker {w.spec.name} ({w.spec.argv[0]}): {exc}; "
                                           f"check the command") from None
        child_sock.close()
        w.conn = Connection(parent_sock.detach())
        w.generation += 1
        w.pid = w.popen.pid
        w.sentinel = _process_sentinel(w.popen.pid)
        w.state = "starting"
        w.ready_at = 0.0                 # the stable period runs from this child's READY
        w.started_at = time.monotonic()
        w.deadline = w.started_at + w.spec.ready_timeout_s
        w.last_heartbeat = 0.0
        w.stderr_tail.clear()
        threading.Thread(target=_drain_stderr, args=(w.popen, w.stderr_tail, w.spec.name), daemon=True).start()

    def _terminate(self, w: _Worker, reason: str | None, kill: bool = False) -> None:
        p = w.popen
        if p is not None and p.poll() is None:
            if reason:
                log.info("stopping worker %s: %s", w.spec.name, reason)
            try:
                p.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
                p.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_GRACE_S)
            except ProcessLookupError:
                pass
        elif p is not None:
            p.wait()
        self._close_handles(w)

    def _close_handles(self, w: _Worker) -> None:
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        if w.sentinel is not None:
            try:
                os.close(w.sentinel)
            except OSError:
                pass
            w.sentinel = None

    def _fail(self, w: _Worker, err: WorkerError) -> None:
        """One failure -> one error; then back-off restart, or give up."""
        self._terminate(w, None, kill=isinstance(err, (HeartbeatTimeout, HandshakeTimeout)))
        w.last_error = str(err)
        log.error("%s", err)
        if w.state in ("starting", "handshaking") and not w.ready_event.is_set():
            w.start_error = err              # the initial start() raises it
            w.state = "failed"
            w.ready_event.set()
            return
        self._errors.append(err)
        if self._on_error is not None:
            try:
                self._on_error(err)
            except Exception:  # noqa: BLE001 - a callback never kills the monitor
                log.exception("on_error callback failed")
        if w.ready_at and time.monotonic() - w.ready_at >= w.spec.stable_after_s:
            w.failures_in_row = 0
        w.failures_in_row += 1
        if not w.spec.restart or self._stopping:
            w.state = "failed"
            return
        if w.failures_in_row > w.spec.max_restarts:
            w.state = "failed"
            gave_up = WorkerGaveUp(w.spec.name, f"worker {w.spec.name} failed {w.failures_in_row} times in a row; "
                                                f"not restarting it again: fix the cause ({w.last_error}), "
                                                f"{self._give_up_advice(w.spec.name)}")
            w.last_error = str(gave_up)
            log.error("giving up on worker %s: %s", w.spec.name, gave_up)
            self._errors.append(gave_up)
            if self._on_error is not None:
                try:
                    self._on_error(gave_up)
                except Exception:  # noqa: BLE001 - a callback never kills the monitor
                    log.exception("on_error callback failed")
            return
        delay = min(w.spec.backoff_max_s, w.spec.backoff_initial_s * 2 ** (w.failures_in_row - 1))
        w.state = "backoff"
        w.deadline = time.monotonic() + delay
        log.info("restarting worker %s in %.2f s (failure %d in a row)", w.spec.name, delay, w.failures_in_row)

    # ------------------------------------------------------------------ monitor thread

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _monitor_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                waitables: list[Any] = [self._wake_r]
                owners: dict[Any, tuple[_Worker, str, int]] = {}
                for w in self._workers.values():
                    if w.conn is not None:
                        waitables.append(w.conn)
                        owners[id(w.conn)] = (w, "conn", w.generation)
                    if w.sentinel is not None:
                        waitables.append(w.sentinel)
                        owners[("fd", w.sentinel)] = (w, "sentinel", w.generation)
                now = time.monotonic()
                timeout = min([MONITOR_TICK_S] + [max(0.0, w.deadline - now) for w in self._workers.values()
                                                  if w.state in ("starting", "handshaking", "backoff")])
            try:
                ready = wait(waitables, timeout=timeout)
            except (OSError, ValueError):      # a handle closed under us (restart/stop): look again
                ready = []
            with self._lock:
                if self._stopping:
                    return
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                # A handle may have been closed (and its number reused) by restart() while we waited:
                # act only on handles of the same child generation.
                found = [owners.get(("fd", obj) if isinstance(obj, int) else id(obj)) for obj in ready]
                for entry in found:
                    if entry is not None and entry[1] == "conn" and entry[0].generation == entry[2] \
                            and entry[0].conn is not None:
                        self._on_message(entry[0])
                # deaths after messages, so a final frame before exit is read first
                for entry in found:
                    if entry is not None and entry[1] == "sentinel" and entry[0].generation == entry[2] \
                            and entry[0].popen is not None and entry[0].popen.poll() is not None:
                        self._on_exit(entry[0])
                self._check_deadlines()

    def _on_message(self, w: _Worker) -> None:
        try:
            message = decode(w.conn.recv_bytes(MAX_FRAME_BYTES))
        except (EOFError, OSError):
            return                          # the sentinel reports the exit
        except ValueError as exc:
            log.warning("worker %s sent a malformed frame: %s", w.spec.name, exc)
            return
        kind = message["type"]
        now = time.monotonic()
        if kind == HELLO and w.state == "starting":
            if message.get("protocol") != PROTOCOL_VERSION:
                self._reject(w, ConfigMismatch(w.spec.name, f"worker {w.spec.name} speaks supervisor protocol "
                                                            f"{message.get('protocol')}, the coordinator {PROTOCOL_VERSION}: "
                                                            f"install the same version of ft everywhere"))
                return
            if message.get("config_hash") != w.spec.config_hash:
                self._reject(w, ConfigMismatch(
                    w.spec.name, f"worker {w.spec.name} (pid {message.get('pid')}) has config hash "
                                 f"{message.get('config_hash')!r}, the coordinator expects {w.spec.config_hash!r}: it "
                                 f"was started with another config or version; restart it from the same config"))
                return
            w.conn.send_bytes(encode({"type": WELCOME}))
            w.state = "handshaking"
        elif kind == READY and w.state == "handshaking":
            w.state = "ready"
            w.ready_at = w.last_heartbeat = now
            w.ready_event.set()
            log.info("worker %s ready (pid %d)", w.spec.name, w.pid)
        elif kind == HEARTBEAT:
            w.last_heartbeat = now
        else:
            log.warning("worker %s sent %r in state %s; ignored", w.spec.name, kind, w.state)

    def _reject(self, w: _Worker, err: WorkerError) -> None:
        try:
            w.conn.send_bytes(encode({"type": REJECT, "reason": str(err)}))
        except OSError:
            pass
        self._fail(w, err)

    def _on_exit(self, w: _Worker) -> None:
        code = w.popen.wait() if w.popen is not None else None
        phase = "before READY" if w.state in ("starting", "handshaking") else "while serving"
        time.sleep(0.02)                         # let the stderr reader catch the last lines
        self._fail(w, WorkerExited(w.spec.name, code, phase, "\n".join(w.stderr_tail)))

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for w in self._workers.values():
            if w.sentinel is None and w.popen is not None and w.state not in ("backoff", "failed", "stopped") \
                    and w.popen.poll() is not None:
                self._on_exit(w)          # no pidfd on this platform: the tick sees the death
            elif w.state in ("starting", "handshaking") and now > w.deadline:
                step = "no HELLO" if w.state == "starting" else "HELLO but no READY"
                self._fail(w, HandshakeTimeout(w.spec.name, f"worker {w.spec.name} sent {step} within "
                                                            f"{w.spec.ready_timeout_s:g} s; see its log, or raise "
                                                            f"its ready timeout if it loads slowly"))
            elif w.state == "ready" and w.failures_in_row and now - w.ready_at >= w.spec.stable_after_s:
                log.info("worker %s has been ready for %.0f s: its failure count and back-off start afresh",
                         w.spec.name, now - w.ready_at)
                w.failures_in_row = 0
            elif (w.state == "ready" and w.spec.heartbeat_timeout_s > 0
                  and now - w.last_heartbeat > w.spec.heartbeat_timeout_s):
                self._fail(w, HeartbeatTimeout(w.spec.name, f"worker {w.spec.name} sent no heartbeat for "
                                                            f"{now - w.last_heartbeat:.1f} s (hung?); killed it"))
            elif w.state == "backoff" and now >= w.deadline:
                w.restarts += 1
                try:
                    self._spawn(w)
                except WorkerError as err:
                    self._fail(w, err)


def _process_sentinel(pid: int) -> int | None:
    """An fd that becomes readable when the process exits (Linux pidfd)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # pragma: no cover - non-Linux: deaths are seen by poll() on the tick
        return None


def _drain_stderr(popen: subprocess.Popen, tail: deque, name: str) -> None:
    """Forward the child's stderr to our log, keeping the last lines for error messages."""
    stream = popen.stderr
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        tail.append(line)
        log.info("[%s] %s", name, line)
    stream.close()
