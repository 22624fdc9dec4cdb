"""The GPU worker process: `run_gpu_worker` (entry of `ft worker gpu`).

Start-up, in this order: process checklist (done by the CLI before torch is imported); the supervisor
link's HELLO when the coordinator started us (a wrong config fails here, before any loading); connect
the engine link, KNOCK until a CHALLENGE proves the coordinator holds the run's key (the key file, read
again at every KNOCK: proto/link_auth.py), answer it with HELLO and our proof, until WELCOME (which names
the expert store to attach); load the dense
model and the expert backend; READY on both links; then `gpu_busy_loop` until SHUTDOWN, SIGTERM
(drain first), the parent's end-of-file on the supervisor link, or the coordinator going silent.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ftexpert.proto import engine_messages as em
from ftexpert.proto import link_auth
from ftexpert.proto.sd_notify import process_notifier
from ftexpert.proto.supervised_child import ENV_FD, HandshakeRejected, SupervisorLink

from ftexpert.gpu_worker.worker_link import CoordinatorLink
from ftexpert.gpu_worker.worker_loop import LocalStop, gpu_busy_loop

if TYPE_CHECKING:
    from ftexpert.gpu_worker.assembly.build import BuiltEngine

log = logging.getLogger("ft.gpu_worker")

DEFAULT_HANDSHAKE_TIMEOUT_S = 120.0
SUPERVISOR_HEARTBEAT_S = 1.0
EXIT_BAD_CONFIG = 2
EXIT_REJECTED = 78                    # EX_CONFIG: the coordinator refused our config; restarting will not help


class HandshakeFailed(RuntimeError):
    """The coordinator never answered."""


class Rejected(RuntimeError):
    """The coordinator (or the supervisor) refused this worker's config."""


@dataclasses.dataclass
class GpuWorkerOptions:
    """The worker's own settings: how it reaches its coordinator. What engine it builds comes in WELCOME."""
    engine_addr: str
    name: str = "gpu0"
    store_name: str | None = None              # default: the name WELCOME gives
    key_file: str | None = None                # the run's engine-link key (default: beside the ipc socket)
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    drain_timeout_s: float = 30.0


@dataclasses.dataclass
class LoadedEngine:
    built: "BuiltEngine"
    ready: em.Ready

    @property
    def engine(self) -> Any:
        return self.built.engine


def say_hello(link: CoordinatorLink, inbox: queue.SimpleQueue, hello: em.Hello, timeout_s: float,
              key_file: str) -> em.Welcome | None:
    """KNOCK (resent every HELLO_RESEND_S), check the CHALLENGE's proof, HELLO with ours, until WELCOME; None when
    told to stop first. `hello` is sent with its proof filled in. A peer that cannot prove the key is ignored."""
    deadline = time.monotonic() + timeout_s
    next_send = 0.0
    knocks: dict[bytes, bytes] = {}                    # our recent nonces -> the key read when we sent them
    answered = False
    problem = ""
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise HandshakeFailed(f"no WELCOME from the coordinator at {link.addr} within {timeout_s:g} s"
                                  f"{f' ({problem})' if problem else ''}; start it (`ft serve --attach --engine-addr "
                                  f"{link.addr}`, systemctl start ft-coordinator) or check --engine-addr and "
                                  f"--engine-key-file")
        if now >= next_send:
            next_send = now + em.HELLO_RESEND_S
            try:
                secret = link_auth.read_secret(key_file)
            except FileNotFoundError:
                problem = f"no key file {key_file} yet"
            except (link_auth.LinkAuthError, link_auth.UnsafePath) as exc:
                problem = str(exc)
                log.warning("%s", exc)
            else:
                nonce = link_auth.new_nonce()
                knocks[nonce] = secret
                while len(knocks) > 4:
                    del knocks[next(iter(knocks))]
                link.send(em.Knock(nonce, em.ENGINE_PROTOCOL_VERSION))
        try:
            item = inbox.get(timeout=min(0.2, max(0.0, deadline - now)))
        except queue.Empty:
            continue
        if isinstance(item, em.Challenge):
            secret = knocks.get(item.worker_nonce)
            if secret is None or not link_auth.verify(secret, link_auth.COORDINATOR, item.proof, item.worker_nonce,
                                                      item.nonce):
                problem = f"the peer on {link.addr} could not prove it holds the key in {key_file}"
                log.warning("%s: ignoring it (a coordinator of another run, or not the coordinator)", problem)
                continue
            proof = link_auth.prove(secret, link_auth.WORKER, item.nonce, item.worker_nonce, link.identity)
            link.send(dataclasses.replace(hello, proof=proof))
            answered = True
        elif isinstance(item, em.Welcome) and answered:
            link.watch_coordinator(item.coordinator_pid)
            return item
        elif isinstance(item, em.Reject) and answered:
            raise Rejected(f"the coordinator refused this worker: {item.reason}")
        elif isinstance(item, em.Reject):
            problem = f"the peer on {link.addr} said {item.reason!r}"
        elif isinstance(item, (em.Shutdown, LocalStop)):
            return None


def load_engine(opts: GpuWorkerOptions, welcome: em.Welcome) -> LoadedEngine:
    """The engine WELCOME's spec describes, its experts attached to the coordinator's store (and CPU workers'
    channels); for cpu / hybrid this process then pins itself to the CPUs the CPU workers keep off."""
    # lazy: torch loads from here on (the CLI's process checklist runs before it)
    import torch

    from ftexpert.gpu_worker.assembly.build import Attachment, build_engine

    spec = welcome.spec
    store = opts.store_name or welcome.store_name
    attachment = Attachment(store, tuple(welcome.cpu_channels)) if store else None
    built = build_engine(spec, attachment=attachment, process_name=f"GPU worker {opts.name}")
    engine, device = built.engine, built.device
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    ready = em.Ready(welcome.session, os.getpid(), str(device), gpu_name, built.source.cfg.vocab_size,
                     engine.max_context_tokens, engine.config.max_running_requests, type(built.experts).__name__,
                     built.load_time_s)
    log.info("loaded %s on %s (%s experts) in %.1f s", built.source.description, device, type(built.experts).__name__,
             ready.load_time_s)
    return LoadedEngine(built, ready)


def _close(built: "BuiltEngine") -> None:
    try:
        built.close()
    except Exception:  # noqa: BLE001 - exiting anyway
        log.exception("closing the expert backend failed")


class _SupervisorBridge:
    """coordinator/supervisor.py's link when it started us (proto/supervised_child.py): HELLO/READY/heartbeats;
    its SHUTDOWN (or the parent's end-of-file) becomes a LocalStop in the inbox."""

    def __init__(self, inbox: queue.SimpleQueue):
        self.link = SupervisorLink.from_env()
        self.inbox = inbox

    def hello(self, config_hash: str) -> None:
        self.link.hello(config_hash)

    def ready(self) -> None:
        self.link.ready()
        self.link.start_background(SUPERVISOR_HEARTBEAT_S)
        threading.Thread(target=self._forward_shutdown, name="supervisor-shutdown", daemon=True).start()

    def _forward_shutdown(self) -> None:
        self.link.shutdown_requested.wait()
        self.inbox.put(LocalStop("the supervisor asked to stop (or the coordinator is gone)", drain=False))


def run_gpu_worker(opts: GpuWorkerOptions) -> int:
    """Entry point of one GPU worker (after the process checklist). Returns the exit code."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    supervised = ENV_FD in os.environ
    signal.signal(signal.SIGTERM, lambda *_: inbox.put(LocalStop("SIGTERM", drain=True)))
    if supervised:      # Ctrl-C reaches the whole process group: the coordinator drains, then says SHUTDOWN
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, lambda *_: inbox.put(LocalStop("SIGINT", drain=True)))
    supervisor = _SupervisorBridge(inbox) if supervised else None
    notifier = process_notifier()               # systemd (ft-gpu-worker@.service): READY=1, STATUS=, WATCHDOG=1
    link: CoordinatorLink | None = None
    loaded: LoadedEngine | None = None
    try:
        if supervisor is not None:
            supervisor.hello(em.gpu_worker_supervisor_hash())
        key_file = link_auth.key_file_for(opts.engine_addr, opts.key_file)
        link = CoordinatorLink(opts.engine_addr, f"{opts.name}-{os.getpid()}".encode(), inbox)
        link.start()
        notifier.status(f"saying HELLO to the coordinator at {opts.engine_addr}")
        hello = em.Hello(opts.name, os.getpid(), em.ENGINE_PROTOCOL_VERSION, b"")
        welcome = say_hello(link, inbox, hello, opts.handshake_timeout_s, key_file)
        if welcome is None:
            return 0
        log.info("WELCOME from the coordinator (pid %d, session %d)", welcome.coordinator_pid, welcome.session)
        notifier.status(f"loading the model (session {welcome.session})")
        loaded = load_engine(opts, welcome)
        link.send(loaded.ready)
        if supervisor is not None:
            supervisor.ready()
        notifier.ready(f"serving session {welcome.session} of the coordinator (pid {welcome.coordinator_pid}) on "
                       f"{loaded.ready.device}")
        code = gpu_busy_loop(loaded.engine, inbox, link.send, drain_timeout_s=opts.drain_timeout_s,
                             watchdog=notifier.watchdog)
        notifier.stopping(f"stopped (exit {code})")
        return code
    except (Rejected, HandshakeRejected) as exc:
        log.error("%s", exc)
        return EXIT_REJECTED
    except (HandshakeFailed, ValueError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        log.error("%s", exc)
        if link is not None:
            link.send(em.Error(str(exc), fatal=True))
        return EXIT_BAD_CONFIG
    finally:
        if link is not None:
            link.stop()
        if loaded is not None:
            _close(loaded.built)
