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
    from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend

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
    engine_addr: str
    name: str = "gpu0"
    model: str | None = None
    preset: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    moe_strategy: str = "resident"
    moe_cache_size: int | None = None
    expert_format: str = "auto"                # --expert-format / FREETOKEN_EXPERT_FORMAT (hashed)
    max_running_requests: int = 8
    max_context_tokens: int | None = None
    num_cpu_workers: int = 0
    store_name: str | None = None              # default: the name WELCOME gives
    key_file: str | None = None                # the run's engine-link key (default: beside the ipc socket)
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    drain_timeout_s: float = 30.0
    reserve_cpus: str | None = None            # cpu/hybrid: the CPU workers' reserved CPUs (HybridOptions; not hashed)
    pin_gpu_worker: bool | None = None         # cpu/hybrid: pin to them once loaded; None: $FREETOKEN_PIN_GPU_WORKER
    overlap_decode: bool | None = None         # EngineConfig.overlap_decode (None: on CUDA; not hashed)
    slot_audit_every: int = 0                  # FREETOKEN_MOE_SLOT_AUDIT (a check: not hashed)
    prefill_chunk_tokens: int | None = None    # None: the engine's default for the backend (not hashed)
    eviction_freq_weight: int | None = None    # the slot cache's eviction key (None: the knob's default; not hashed)
    eviction_freq_half_life: int | None = None
    prefetch: Any = None                       # PrefetchSettings of the lookahead prefetch (None: off; not hashed)

    def engine_config(self) -> dict[str, Any]:
        return em.engine_config(model=os.path.abspath(self.model) if self.model else None, preset=self.preset,
                                dtype=self.dtype, moe_strategy=self.moe_strategy, moe_cache_size=self.moe_cache_size,
                                max_running_requests=self.max_running_requests,
                                max_context_tokens=self.max_context_tokens, num_cpu_workers=self.num_cpu_workers,
                                expert_format=self.expert_format)


@dataclasses.dataclass
class LoadedEngine:
    engine: Any
    ready: em.Ready
    experts: "ExpertBackend"          # the expert backend (closed at exit: detaches the store)


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
    """Dense model on the device + the expert backend (attached to the coordinator's store) + the Engine."""
    t0 = time.perf_counter()
    import torch

    from ftexpert.gpu_worker.engine import Engine, EngineConfig
    from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions
    from ftexpert.gpu_worker.assembly.attached_backends import make_attached_expert_backend
    from ftexpert.gpu_worker.assembly.device import resolve_device
    from ftexpert.gpu_worker.assembly.loader import open_model_source
    from ftexpert.gpu_worker.models.architectures import make_model
    from ftexpert.gpu_worker.backends.offload.prefetch import attach_prefetch

    device = resolve_device(opts.device)
    source = open_model_source(opts.model, opts.preset, dtype=opts.dtype, device=device,
                               expert_format=opts.expert_format)
    experts = make_attached_expert_backend(opts.moe_strategy, source.experts, device,
                                           store_name=opts.store_name or welcome.store_name,
                                           cpu_channels=welcome.cpu_channels, cache_size=opts.moe_cache_size,
                                           hybrid=HybridOptions(reserve_cpus=opts.reserve_cpus),
                                           freq_weight=opts.eviction_freq_weight,
                                           freq_half_life=opts.eviction_freq_half_life)
    try:
        dense = source.load_dense(device)
        cfg = source.cfg
        model = make_model(cfg, dense, experts, max_positions=min(32768, cfg.max_position_embeddings))
        attach_prefetch(model, opts.prefetch)
        engine = Engine(model, EngineConfig(max_running_requests=opts.max_running_requests,
                                            max_context_tokens=opts.max_context_tokens,
                                            slot_audit_every=opts.slot_audit_every,
                                            prefill_chunk_tokens=opts.prefill_chunk_tokens,
                                            overlap_decode=opts.overlap_decode), source.eos_token_ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except BaseException:
        _close(experts)
        raise
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    ready = em.Ready(welcome.session, os.getpid(), str(device), gpu_name, cfg.vocab_size, engine.max_context_tokens,
                     engine.config.max_running_requests, type(experts).__name__, time.perf_counter() - t0)
    log.info("loaded %s on %s (%s experts) in %.1f s", source.description, device, type(experts).__name__,
             ready.load_time_s)
    return LoadedEngine(engine, ready, experts)


def pin_to_reserved_cpus(opts: GpuWorkerOptions) -> tuple[int, ...] | None:
    """cpu/hybrid: pin this process (every thread) to the reserved CPUs the CPU workers keep off
    (HybridOptions.pin_driving_process). Its CPU workers are the coordinator's children, not ours, so
    nothing inherits the narrowed mask; a restarted GPU worker starts from its starter's affinity again."""
    if opts.moe_strategy not in em.CPU_POOL_STRATEGIES:
        return None
    from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions

    return HybridOptions(reserve_cpus=opts.reserve_cpus, pin_gpu_worker=opts.pin_gpu_worker).pin_driving_process(
        f"GPU worker {opts.name}")


def _close(experts: "ExpertBackend") -> None:
    try:
        experts.close()
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
    config = opts.engine_config()
    config_hash = em.engine_config_hash(config)
    supervisor = _SupervisorBridge(inbox) if supervised else None
    notifier = process_notifier()               # systemd (ft-gpu-worker@.service): READY=1, STATUS=, WATCHDOG=1
    link: CoordinatorLink | None = None
    loaded: LoadedEngine | None = None
    try:
        if supervisor is not None:
            supervisor.hello(config_hash)
        key_file = link_auth.key_file_for(opts.engine_addr, opts.key_file)
        link = CoordinatorLink(opts.engine_addr, f"{opts.name}-{os.getpid()}".encode(), inbox)
        link.start()
        notifier.status(f"saying HELLO to the coordinator at {opts.engine_addr}")
        hello = em.Hello(opts.name, os.getpid(), em.ENGINE_PROTOCOL_VERSION, config_hash, em.config_json(config), b"")
        welcome = say_hello(link, inbox, hello, opts.handshake_timeout_s, key_file)
        if welcome is None:
            return 0
        log.info("WELCOME from the coordinator (pid %d, session %d)", welcome.coordinator_pid, welcome.session)
        notifier.status(f"loading the model (session {welcome.session})")
        loaded = load_engine(opts, welcome)
        pin_to_reserved_cpus(opts)             # after loading, which uses every core it may
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
            _close(loaded.experts)
