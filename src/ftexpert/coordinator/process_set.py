"""The coordinator's worker processes (`ft serve --workers process`, and `--attach`): `ProcessSet`.

open_model() (start() calls it first when the caller did not):
  1. `ft worker store` (coordinator/model_child.py) opens the model the spec names and reports its facts
     (proto/model_facts.py: vocabulary, tokenizer directory, the experts' shape and format); this process
     imports neither torch nor the model-loading code.
  2. the expert store and the CPU workers' channels, through the one owner of those
     (coordinator/expert_resources.py): the store created here under a fixed name from those facts and filled
     by that child, which then exits (a segment of that name left by a killed run, its creator dead, is
     reclaimed; a live one is an error naming its pid).
start(), then:
  3. the engine link: a fresh key in the private runtime directory (proto/link_auth.py: engine.key, 0600,
     in a 0700 directory of this user), then a ROUTER on --engine-addr (default ipc://<that dir>/engine.sock;
     TCP only on loopback and only when asked for); a worker proves the key before it learns anything.
  4. `--workers process`: the supervisor starts `ft worker cpu` x N and `ft worker gpu` and waits for
     each HELLO + READY; it restarts a dead one with back-off. The GPU worker builds the engine of the spec
     that WELCOME carries (proto/engine_spec.py). cpu/hybrid: the CPU workers get this process's affinity
     (--allowed-cpus) and the reserved CPUs; the spec names the same reserved CPUs, where the GPU worker
     pins itself once loaded (--pin-gpu-worker).
     `--attach`: nothing is started; the GPU worker (systemd: ft-gpu-worker@0) must say HELLO + READY
     within --worker-ready-timeout-s.
  5. READY's facts are checked against the model's facts (vocabulary).
stop(): SHUTDOWN to the GPU worker, the supervisor stops its children, the link closes, then the
channels and the store are unlinked (by their creator, this process, only).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

from ftexpert.coordinator.engine_link import EngineLinkServer
from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources
from ftexpert.coordinator.remote_engine import RemoteEngine
from ftexpert.coordinator.supervisor import EXIT_WORKERS_GAVE_UP, Supervisor, WorkerGaveUp, WorkerSpec
from ftexpert.cpu_expert_pool.api import FT_COMMAND, default_worker_count, worker_env
from ftexpert.proto import engine_messages as em
from ftexpert.proto import link_auth
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.model_facts import ModelFacts

log = logging.getLogger("ft.coordinator.process_set")

GPU_WORKER_NAME = "gpu0"
LINK_READY_GRACE_S = 10.0                           # supervisor READY -> engine-link READY
GPU_HEARTBEAT_TIMEOUT_S = 10.0


def default_store_name(port: int) -> str:
    """Fixed per HTTP port, so that the next start on that port finds (and reclaims) a killed run's store."""
    return f"ft-experts-{port}" if port else f"ft-experts-pid{os.getpid()}"


@dataclass
class ProcessSetOptions:
    attach: bool
    spec: EngineSpec                         # the engine the GPU worker builds (sent whole in WELCOME)
    engine_addr: str | None = None           # None: ipc://<runtime dir>/engine.sock (link_auth.default_engine_addr)
    http_port: int = 0                       # names the default runtime directory (0: a fresh private one)
    store_name: str = ""
    worker_ready_timeout_s: float = 600.0
    log_level: str = "INFO"
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    exit_on_give_up: bool = True             # --on-worker-give-up exit: the coordinator exits once one is given up on
    extra_env: dict[str, str] = field(default_factory=dict)


def options_from_serve_args(args: Any, spec: EngineSpec) -> ProcessSetOptions:
    """`ft serve`'s process-set flags around the engine `spec` (its CPU worker count resolved: 0 = one per NUMA
    node or core group)."""
    if spec.uses_cpu_pool and spec.num_cpu_workers <= 0:
        spec = dataclasses.replace(spec, num_cpu_workers=default_worker_count())
    return ProcessSetOptions(attach=args.attach, spec=spec, engine_addr=args.engine_addr, http_port=args.port,
                             store_name=args.store_name or default_store_name(args.port),
                             worker_ready_timeout_s=args.worker_ready_timeout_s, log_level=args.log_level,
                             exit_on_give_up=args.on_worker_give_up == "exit")


class ProcessSet:
    def __init__(self, options: ProcessSetOptions):
        self.options = options
        self.resources: ExpertResources | None = None    # the model's facts, the store and the CPU channels
        self.link: EngineLinkServer | None = None
        self.supervisor: Any = None
        self.remote: RemoteEngine | None = None
        # (worker name, message, is the GPU worker) when the supervisor gives up on a worker (its thread)
        self.on_gave_up: Callable[[str, str, bool], None] | None = None
        self.key_file: str | None = None     # the run's engine-link key (the GPU worker proves it)
        self._made_dir: str | None = None    # a runtime directory this run made, removed at stop() when empty

    # ------------------------------------------------------------------ start

    def open_model(self) -> ModelFacts:
        """The model's facts; the store filled and the channels made, for the strategies that use them (once)."""
        res = self.resources or self.create_resources()
        assert res.model is not None
        return res.model

    def start(self) -> em.Ready:
        o = self.options
        self.open_model()
        res = self.resources
        assert res is not None
        addr = self.engine_addr()
        secret = link_auth.new_secret()
        self.key_file = link_auth.write_secret(self.runtime_dir(addr), secret)
        spec = o.spec
        if spec.uses_cpu_pool:          # the GPU worker pins itself to the CPUs the CPU workers keep off
            spec = dataclasses.replace(spec, reserve_cpus=res.reserved_cpus())
        self.link = EngineLinkServer(addr, spec, secret=secret, store_name=res.store_name,
                                     cpu_channels=tuple(res.channel_names))
        self.link.start()
        log.info("engine link on %s (key %s, engine spec %s)", self.link.address, self.key_file, self.link.spec_hash)
        if o.attach:
            print(f"ft serve: waiting up to {o.worker_ready_timeout_s:g} s for a GPU worker on {self.link.address}",
                  file=sys.stderr, flush=True)
            facts = self.link.wait_ready(o.worker_ready_timeout_s)
        else:
            self.supervisor = Supervisor(self.worker_specs(), on_error=self._on_worker_error,   # it logs each
                                         give_up_advice=self.give_up_advice)
            self.supervisor.start()
            facts = self.link.wait_ready(LINK_READY_GRACE_S, what=f"GPU worker {GPU_WORKER_NAME}")
        self._check_facts(facts)
        return facts

    def engine_addr(self) -> str:
        o = self.options
        if o.engine_addr:
            return o.engine_addr
        if o.http_port or os.environ.get("RUNTIME_DIRECTORY"):
            return link_auth.default_engine_addr(o.http_port)
        base = link_auth.private_dir(link_auth.base_runtime_dir())
        self._made_dir = tempfile.mkdtemp(prefix="ft-", dir=base)          # port 0: nothing fixed to find
        return f"ipc://{os.path.join(self._made_dir, link_auth.SOCKET_NAME)}"

    def runtime_dir(self, addr: str) -> str:
        """The private directory of the key (and of an ipc socket): the socket's, else the default one."""
        path = link_auth.ipc_path(addr)
        directory = (os.path.dirname(os.path.abspath(path)) if path is not None
                     else self._made_dir or link_auth.default_runtime_dir(self.options.http_port))
        if not os.path.exists(directory):
            self._made_dir = directory                 # ours: removed at stop() (when empty)
        return link_auth.private_dir(directory)

    def create_resources(self) -> ExpertResources:
        """The model's facts, the store and the CPU workers' channels, through their owner (kept until stop())."""
        o = self.options
        cpu = CpuWorkerSettings(num_workers=max(1, o.spec.num_cpu_workers), reserve_cpus=o.spec.reserve_cpus,
                                act_quant=o.spec.cpu_act_quant,
                                log_level=o.log_level, ready_timeout_s=o.worker_ready_timeout_s,
                                backoff_initial_s=o.backoff_initial_s, backoff_max_s=o.backoff_max_s,
                                max_restarts=o.max_restarts)
        # no time limit: filling the store takes what the checkpoint's size and the disk make it take (as it did
        # in this process before); SIGTERM at start-up interrupts the wait, and the child dies with this process
        self.resources = ExpertResources.open_in_child(o.spec, store_name=o.store_name or default_store_name(0),
                                                       cpu=cpu, log_level=o.log_level)
        return self.resources

    def worker_specs(self) -> list[Any]:
        """The supervised children: `ft worker cpu` x N (cpu/hybrid: the owner's), then `ft worker gpu`."""
        o = self.options
        assert self.link is not None and self.resources is not None
        env = {"PYTHONPATH": worker_env()["PYTHONPATH"], **o.extra_env}
        specs = self.resources.cpu_worker_specs()
        for spec in specs:
            spec.env = env
        argv = [*FT_COMMAND, "worker", "gpu", "--engine-addr", self.link.address, "--name", GPU_WORKER_NAME,
                "--parent-pid", str(os.getpid()), "--log-level", o.log_level]
        if self.key_file:
            argv += ["--engine-key-file", self.key_file]
        specs.append(WorkerSpec(GPU_WORKER_NAME, argv, em.gpu_worker_supervisor_hash(), env=env, kind="gpu-worker",
                                ready_timeout_s=o.worker_ready_timeout_s, heartbeat_timeout_s=GPU_HEARTBEAT_TIMEOUT_S,
                                backoff_initial_s=o.backoff_initial_s, backoff_max_s=o.backoff_max_s,
                                max_restarts=o.max_restarts))
        return specs

    def give_up_advice(self, name: str) -> str:
        """What brings worker `name` back once the supervisor gave up on it, in each --on-worker-give-up mode."""
        if self.options.exit_on_give_up:
            return (f"then start the set again: the coordinator drains and exits with code {EXIT_WORKERS_GAVE_UP} "
                    f"(--on-worker-give-up exit) for its service manager to restart it (systemd: Restart=on-failure); "
                    f"started by hand, run `ft serve` again")
        return f"then restart it with `ft ctl restart {name}` (--on-worker-give-up stay: the coordinator keeps serving)"

    def _on_worker_error(self, err: Exception) -> None:
        if isinstance(err, WorkerGaveUp) and self.on_gave_up is not None:
            self.on_gave_up(err.name, str(err), err.name == GPU_WORKER_NAME)

    def _check_facts(self, facts: em.Ready) -> None:
        assert self.resources is not None and self.resources.model is not None
        vocab = self.resources.model.vocab_size
        if facts.vocab_size != vocab:
            raise RuntimeError(f"the GPU worker (pid {facts.pid}) loaded a model with a vocabulary of "
                               f"{facts.vocab_size} tokens, the coordinator's tokenizer model has {vocab}: start "
                               f"both with the same --model")

    # ------------------------------------------------------------------ engine

    def engine_client(self) -> RemoteEngine:
        """EngineService's engine: the one RemoteEngine over the link."""
        if self.remote is None:
            assert self.link is not None, "start() first"
            restart = self._restart_gpu_worker if self.supervisor is not None else None
            self.remote = RemoteEngine(self.link, restart_worker=restart)
        return self.remote

    @property
    def engine_worker(self) -> str | None:
        """The supervised worker that runs the engine (None with --attach: the GPU worker is not ours)."""
        return GPU_WORKER_NAME if self.supervisor is not None else None

    def _restart_gpu_worker(self) -> None:
        self.supervisor.restart(GPU_WORKER_NAME)

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.closing = True
            peer = link.peer
            if peer is not None:
                link.send_to(peer.session, em.Shutdown("the coordinator is stopping"))
        if self.supervisor is not None:
            try:
                self.supervisor.stop()
            except Exception:  # noqa: BLE001 - keep tearing down
                log.exception("stopping the worker processes failed")
            self.supervisor = None
        if link is not None:
            link.close()
            link_auth.remove_quietly(self.key_file)
            path = link_auth.ipc_path(link.address)
            link_auth.remove_quietly(path)
            if self._made_dir:
                try:
                    os.rmdir(self._made_dir)
                except OSError:
                    pass
        if self.resources is not None:
            self.resources.close()               # the creator: unlinks the channels and the store
            self.resources = None
