"""The coordinator's end of the engine link: `EngineLinkServer`, an IO thread around a ROUTER socket.

It accepts one GPU worker at a time, and only one that proves the run's key (proto/link_auth.py): KNOCK
gets a CHALLENGE carrying the coordinator's proof; a HELLO whose proof fails gets REJECT "not authorized"
and nothing else (the details go to this process's log only). An authenticated HELLO of the same protocol gets
WELCOME (a new session) carrying the engine spec to build; another protocol, or a second live worker, gets
REJECT. It watches
the peer through a pidfd on the pid its HELLO gave (loopback only: the worker is on this host) and
through silence longer than peer_timeout_s; either way the session is *lost*. It sends heartbeats.

What it learns goes, as one event, to the listener (`set_listener`; RemoteEngine's hands it to the event
loop); events before a listener is set are kept and replayed to it:

    ("ready", session, Ready)         the worker loaded the model and serves
    ("lost", session, reason)         the worker died or went silent; its requests are gone
    ("msg", session, message)         TOKEN_BATCH / REQUEST_FAILED / STATS / DRAINED / ERROR

`wait_ready(timeout_s)` is the start-up handshake: READY, or one error naming the peer and the fix.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ftexpert.proto import engine_messages as em
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto import link_auth
from ftexpert.proto.link_io import LinkIO, check_loopback_address

log = logging.getLogger("ft.coordinator.engine_link")

MAX_REJECTIONS_KEPT = 16              # a misconfigured worker restarted in a loop must not grow memory
MAX_EVENTS_KEPT = 1024                # events kept while no listener is set
MAX_PENDING_CHALLENGES = 64           # KNOCKs awaiting their HELLO (a flood of knocks must not grow memory)
CHALLENGE_TTL_S = 30.0                # a CHALLENGE not answered within this is forgotten
MAX_MESSAGE_BYTES = 16 << 20          # what a worker (or anyone who connects) may send in one frame
NOT_AUTHORIZED = "not authorized"


class PeerMismatch(RuntimeError):
    """A GPU worker of another engine-link protocol tried to connect."""


class PeerMissing(RuntimeError):
    """No GPU worker became READY in time."""


@dataclass
class Peer:
    identity: bytes
    hello: em.Hello
    session: int
    pidfd: int | None
    last_rx: float
    last_tx: float = 0.0
    ready: em.Ready | None = None

    @property
    def label(self) -> str:
        return f"{self.hello.name} (pid {self.hello.pid})"


class EngineLinkServer(LinkIO):
    def __init__(self, addr: str, spec: EngineSpec, *, secret: bytes | None = None, store_name: str = "",
                 cpu_channels: tuple[str, ...] = (), heartbeat_interval_s: float = em.DEFAULT_HEARTBEAT_INTERVAL_S,
                 peer_timeout_s: float = em.DEFAULT_PEER_TIMEOUT_S):
        super().__init__("ft-engine-link")
        check_loopback_address(addr)
        self.secret = secret if secret is not None else link_auth.new_secret()   # the run's key (workers prove it)
        self._challenges: dict[bytes, tuple[bytes, bytes, float]] = {}   # identity -> (worker nonce, ours, when)
        self.auth_failures_total = 0
        self.last_auth_failure = ""
        self.spec = spec
        self.spec_hash = em.spec_hash(spec.to_wire())
        self.store_name = store_name
        self.cpu_channels = list(cpu_channels)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.peer_timeout_s = peer_timeout_s
        self._listener: Callable[[tuple], None] | None = None
        self._kept: list[tuple] = []
        self._listener_lock = threading.Lock()
        self.peer: Peer | None = None
        self.sessions_total = 0
        self.rejections: list[str] = []
        self.closing = False                  # set before a deliberate SHUTDOWN: the exit is no failure
        self._cond = threading.Condition()
        zmq = self.zmq
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)     # a second connection cannot take a live peer's identity
        try:
            _refuse_a_live_ipc_socket(addr)
            self.sock.bind(addr[:-2] + ":*" if addr.startswith("tcp://") and addr.endswith(":0") else addr)
        except (zmq.ZMQError, RuntimeError) as exc:
            self.sock.close(0)
            raise RuntimeError(f"cannot listen for GPU workers on {addr}: {exc}; pick another --engine-addr "
                               f"(or stop the process that holds it)") from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # ------------------------------------------------------------------ any thread

    def set_listener(self, listener: Callable[[tuple], None] | None) -> None:
        """Where events go from now on (it runs in the IO thread and must not block); the kept ones first."""
        with self._listener_lock:
            self._listener = listener
            if listener is not None:
                kept, self._kept = self._kept, []
                for event in kept:
                    listener(event)

    def _emit(self, event: tuple) -> None:
        with self._listener_lock:
            if self._listener is not None:
                self._listener(event)
            elif len(self._kept) < MAX_EVENTS_KEPT:
                self._kept.append(event)

    def send_to(self, session: int, msg) -> None:
        """Queue `msg` for the worker of `session`; dropped if that session is gone by then."""
        self.send((session, msg))

    @property
    def peer_pid(self) -> int:
        peer = self.peer
        return peer.hello.pid if peer is not None else 0

    def wait_ready(self, timeout_s: float, what: str = "a GPU worker") -> em.Ready:
        """Block until a worker is READY; PeerMismatch at the first rejected HELLO, PeerMissing on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self.rejections:
                    raise PeerMismatch(self.rejections[0])
                peer = self.peer
                if peer is not None and peer.ready is not None:
                    return peer.ready
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    state = (f"{peer.label} said HELLO but was not READY" if peer is not None
                             else "none connected")
                    if peer is None and self.auth_failures_total:
                        state += (f"; {self.auth_failures_total} peer(s) failed to authenticate, the last: "
                                  f"{self.last_auth_failure}")
                    raise PeerMissing(f"{what} did not become READY on {self.address} within {timeout_s:g} s "
                                      f"({state}); start it (`ft worker gpu --engine-addr {self.address} ...` or "
                                      f"`systemctl start ft-gpu-worker@0`), or raise --worker-ready-timeout-s "
                                      f"if it loads slowly")
                self._cond.wait(min(remaining, 0.5))

    def close(self, timeout_s: float = 2.0) -> None:
        self.stop(timeout_s)

    # ------------------------------------------------------------------ IO thread

    def frames_for(self, item) -> list[bytes] | None:
        session, msg = item
        peer = self.peer
        if peer is None or peer.session != session:
            return None
        peer.last_tx = time.monotonic()
        return [peer.identity, *em.encode(msg)]

    def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        identity = frames[0]
        try:
            msg = em.decode(frames[1:])
        except em.MessageError as exc:
            log.warning("dropping a malformed engine-link message from %r: %s", identity, exc)
            return
        if isinstance(msg, em.Knock):
            self._on_knock(identity, msg)
            return
        if isinstance(msg, em.Hello):
            if self._authenticated(identity, msg):
                self._on_hello(identity, msg)
            return
        peer = self.peer
        if peer is None or peer.identity != identity:
            log.debug("ignoring %s from %r, which has no session", type(msg).__name__, identity)
            return
        peer.last_rx = time.monotonic()
        if isinstance(msg, em.Ready):
            if msg.session != peer.session or peer.ready is not None:
                return
            with self._cond:
                peer.ready = msg
                self._cond.notify_all()
            log.info("GPU worker %s ready: %s, %s, load %.1f s", peer.label, msg.device, msg.expert_backend,
                     msg.load_time_s)
            self._emit(("ready", peer.session, msg))
        elif isinstance(msg, em.Heartbeat):
            pass
        else:
            if isinstance(msg, em.Error):
                log.error("GPU worker %s reports%s: %s", peer.label, " (fatal)" if msg.fatal else "", msg.message)
            self._emit(("msg", peer.session, msg))

    def _reply(self, identity: bytes, msg) -> None:
        self.send_frames([identity, *em.encode(msg)])

    def _on_knock(self, identity: bytes, knock: em.Knock) -> None:
        now = time.monotonic()
        for key in [k for k, (_, _, t) in self._challenges.items() if now - t > CHALLENGE_TTL_S]:
            del self._challenges[key]
        if knock.protocol_version != em.ENGINE_PROTOCOL_VERSION or len(knock.nonce) != link_auth.NONCE_BYTES:
            self._refuse(identity, f"a KNOCK of engine-link protocol {knock.protocol_version} (this coordinator "
                                   f"speaks {em.ENGINE_PROTOCOL_VERSION}; install the same version of ft everywhere)")
            return
        while len(self._challenges) >= MAX_PENDING_CHALLENGES:
            del self._challenges[next(iter(self._challenges))]
        ours = link_auth.new_nonce()
        self._challenges.pop(identity, None)
        self._challenges[identity] = (knock.nonce, ours, now)
        self._reply(identity, em.Challenge(knock.nonce, ours,
                                           link_auth.prove(self.secret, link_auth.COORDINATOR, knock.nonce, ours)))

    def _authenticated(self, identity: bytes, hello: em.Hello) -> bool:
        """The HELLO answers this identity's CHALLENGE with the key; else REJECT "not authorized", logged here."""
        pending = self._challenges.pop(identity, None)
        if pending is None:
            self._refuse(identity, f"a HELLO without a CHALLENGE (claims {hello.name}, pid {hello.pid}; an ft older "
                                   f"than engine-link protocol {em.ENGINE_PROTOCOL_VERSION}?)")
            return False
        worker_nonce, ours, _ = pending
        if not link_auth.verify(self.secret, link_auth.WORKER, hello.proof, ours, worker_nonce, identity):
            self._refuse(identity, f"a HELLO with a wrong proof of the key (claims {hello.name}, pid {hello.pid}): "
                                   f"not this run's key file (a stale --engine-key-file, or not the service user)")
            return False
        return True

    def _refuse(self, identity: bytes, what: str) -> None:
        """An unauthenticated peer: it is told nothing but NOT_AUTHORIZED; this log has the details."""
        self.auth_failures_total += 1
        self.last_auth_failure = f"{what} from link identity {identity!r}"
        log.warning("refused an engine-link peer: %s", self.last_auth_failure)
        self._reply(identity, em.Reject(NOT_AUTHORIZED))

    def _on_hello(self, identity: bytes, hello: em.Hello) -> None:
        who = f"GPU worker {hello.name} (pid {hello.pid})"
        if hello.protocol_version != em.ENGINE_PROTOCOL_VERSION:
            self._reject(identity, f"{who} speaks engine-link protocol {hello.protocol_version}, the coordinator "
                                   f"{em.ENGINE_PROTOCOL_VERSION}: install the same version of ft everywhere",
                         "the engine-link protocol differs: install the same version of ft everywhere")
            return
        peer = self.peer
        if peer is not None and peer.identity == identity:
            self._welcome(peer)                          # a resent HELLO: same session
            return
        if peer is not None:
            if _pid_alive(peer) and time.monotonic() - peer.last_rx <= self.peer_timeout_s:
                self._reply(identity, em.Reject(f"{peer.label} is already connected; this coordinator drives one "
                                                f"GPU worker: stop {who}"))
                log.warning("refused %s: %s is already connected", who, peer.label)
                return
            self._lose(f"the GPU worker {peer.label} was replaced by {who}")
        self.sessions_total += 1
        pidfd = _open_pidfd(hello.pid)
        now = time.monotonic()
        peer = Peer(identity, hello, self.sessions_total, pidfd, last_rx=now)
        if pidfd is not None:
            self.watch_fd(pidfd)
        with self._cond:
            self.peer = peer
            self._cond.notify_all()
        log.info("%s said HELLO (session %d)", who, peer.session)
        self._welcome(peer)

    def _welcome(self, peer: Peer) -> None:
        peer.last_tx = time.monotonic()
        self._reply(peer.identity, em.Welcome(peer.session, os.getpid(), self.store_name, list(self.cpu_channels),
                                              self.heartbeat_interval_s, self.peer_timeout_s, self.spec))

    def _reject(self, identity: bytes, reason: str, told: str) -> None:
        """An authenticated worker refused: `reason` for this log and wait_ready, `told` (no values) for it."""
        log.error("%s", reason)
        self._reply(identity, em.Reject(told))
        with self._cond:
            if len(self.rejections) < MAX_REJECTIONS_KEPT:
                self.rejections.append(reason)
            self._cond.notify_all()

    def on_fd(self, fd: int) -> None:
        peer = self.peer
        if peer is not None and fd == peer.pidfd:
            self._lose(f"the GPU worker {peer.label} exited")

    def on_tick(self, now: float) -> None:
        peer = self.peer
        if peer is None:
            return
        if now - peer.last_rx > self.peer_timeout_s:
            self._lose(f"the GPU worker {peer.label} sent nothing for {now - peer.last_rx:.1f} s (hung or gone)")
        elif now - peer.last_tx >= self.heartbeat_interval_s:
            peer.last_tx = now
            self.send_frames([peer.identity, *em.encode(em.Heartbeat())])

    def on_closed(self) -> None:
        peer = self.peer
        if peer is not None and peer.pidfd is not None:
            self.unwatch_fd(peer.pidfd)
            os.close(peer.pidfd)
            peer.pidfd = None

    def _lose(self, reason: str) -> None:
        peer = self.peer
        if peer is None:
            return
        if peer.pidfd is not None:
            self.unwatch_fd(peer.pidfd)
            os.close(peer.pidfd)
            peer.pidfd = None
        with self._cond:
            self.peer = None
            self._cond.notify_all()
        if self.closing:
            log.info("%s (asked to stop)", reason)
        else:
            log.error("%s; requests in flight on it fail", reason)
        self._emit(("lost", peer.session, reason))


def _refuse_a_live_ipc_socket(addr: str) -> None:
    """libzmq binds over an existing ipc socket file, silently taking it from a live coordinator: refuse that; a
    stale file (nobody listening) is removed."""
    path = link_auth.ipc_path(addr)
    if path is None or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    except OSError:
        return
    finally:
        probe.close()
    raise RuntimeError(f"another process listens on {addr} (a coordinator already running?)")


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):     # not Linux, or not visible here: heartbeats still tell
        return None


def _pid_alive(peer: Peer) -> bool:
    if peer.pidfd is None:
        return True
    readable, _, _ = select.select([peer.pidfd], [], [], 0)
    return not readable
