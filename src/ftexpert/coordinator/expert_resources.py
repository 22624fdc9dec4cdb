"""`ExpertResources`: the one owner of the host-side resources of the offload, cpu and hybrid strategies.

    res = ExpertResources.open_in_child(spec, store_name="ft-experts-1919", cpu=CpuWorkerSettings())  # ft serve
    res = ExpertResources.create(source, "hybrid", store_name=..., cpu=...)   # ft generate, ft serve --workers inline
    specs = res.cpu_worker_specs()      # `ft serve`: supervised with the GPU worker by one Supervisor
    res.start_cpu_workers()             # `ft generate`, `ft serve --workers inline`: a Supervisor of its own
    ...                                 # the engine attaches: Attachment(res.store_name, res.channel_names)
    res.close()                         # workers stopped, channels and store unlinked (by their creator, this owner)

In every mode the coordinator's side creates, in this order: the shared-memory expert store (sized from the
model's facts, proto/model_facts.py; for cpu/hybrid its pages bound to the NUMA nodes of the workers that own
them; then filled from the checkpoint once), one hot-path channel per CPU worker, and the CPU workers (`ft worker
cpu`, one command line: cpu_expert_pool.api.worker_argv) under coordinator/supervisor.py (HELLO with the store's
config hash, READY, heartbeats, restarts with back-off). They outlive GPU-worker restarts. The engine only attaches.

Who reads the checkpoint: `open_in_child` (`ft serve`, process mode and --attach) has `ft worker store`
(coordinator/model_child.py) open the model, report its facts and fill the store this owner created, so this
process imports neither torch nor the model-loading code; `create` (the modes that build the engine in this
process anyway) fills it here from a gpu_worker.api.ModelSource. Either way this process created the store and
the channels, so it unlinks them, and a killed coordinator leaves segments the next start reclaims.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable

from ftexpert.coordinator.model_child import ModelChild
from ftexpert.coordinator.supervisor import Supervisor, WorkerSpec
from ftexpert.proto.cpus import parse_cpulist
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.cpu_expert_pool import api as cpu_api
from ftexpert.cpu_expert_pool.api import worker_argv, worker_env
from ftexpert.proto.expert_store import STORE_MAGIC, ExpertStore
from ftexpert.proto.shm_segment import reclaim_stale_segments
from ftexpert.proto.model_facts import ModelFacts
from ftexpert.proto.shm_layout import (CHANNEL_MAGIC, DEFAULT_CPU_MAX_TOKENS, channel_hidden_dtype,
                                       channel_name_for, create_worker_channel)

log = logging.getLogger("ft.coordinator.expert_resources")

HOST_STORE_STRATEGIES = ("offload", "cpu", "hybrid")
CPU_STRATEGIES = ("cpu", "hybrid")
DEFAULT_READY_TIMEOUT_S = 120.0       # a CPU worker imports torch, maps the store and warms up
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0    # a worker silent this long is killed (backstop)
DEFAULT_BACKOFF_S = 0.5               # first restart delay of a failed worker (doubles)


@dataclasses.dataclass
class CpuWorkerSettings:
    """The CPU workers' settings (their `ft worker cpu` flags and their supervision)."""
    num_workers: int = 0                   # 0: one per NUMA node or core group
    threads: int = 0                       # compute threads per worker (0: one per physical core)
    reserve_cpus: str | None = None        # kept free of workers (the GPU-driving process pins itself there)
    act_quant: str = "auto"                # 4-bit experts' activations (the workers' --act-quant)
    worker_args: tuple[str, ...] = ()      # more `ft worker cpu` flags (e.g. --hot-ms 5 --no-pin)
    t_max: int = DEFAULT_CPU_MAX_TOKENS    # tokens a channel takes
    log_level: str = "INFO"
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    backoff_initial_s: float = DEFAULT_BACKOFF_S
    backoff_max_s: float = 30.0
    max_restarts: int = 5

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.threads < 0 or self.t_max < 1:
            raise ValueError(f"CPU workers: num_workers {self.num_workers} and threads {self.threads} must be >= 0, "
                             f"t_max {self.t_max} >= 1")
        self.worker_args = tuple(self.worker_args)


def reclaim_stale_host_memory() -> list[Any]:
    """Every expert store and CPU channel in /dev/shm of this user whose creator died (a killed run, on any
    port, under any name), unlinked and logged (names, bytes); live ones and other users' are kept."""
    return reclaim_stale_segments((STORE_MAGIC, CHANNEL_MAGIC))


class ExpertResources:
    def __init__(self, strategy: str, cpu: CpuWorkerSettings):
        self.strategy, self.cpu = strategy, cpu
        self.model: ModelFacts | None = None   # the model's facts (open_in_child, create)
        self.store: ExpertStore | None = None   # the expert store we created (owner: unlinks it)
        self.channels: list[Any] = []          # ShmSegment per CPU worker (owner)
        self.channel_names: list[str] = []
        self.num_cpu_workers = 0
        self.supervisor: Supervisor | None = None     # start_cpu_workers' own
        self.store_name = self.config_hash = ""
        self._flags: list[str] = []

    @classmethod
    def open_in_child(cls, spec: EngineSpec, *, store_name: str, cpu: CpuWorkerSettings | None = None,
                      log_level: str = "INFO", timeout_s: float | None = None) -> "ExpertResources":
        """The model's facts (`model`) from `ft worker store`, and for offload / cpu / hybrid the store it fills
        and the CPU workers' channels (cpu, hybrid). No torch and no model code in this process. timeout_s: a
        limit for each of the child's two steps (open the model, fill the store); None: as long as they take."""
        res = cls(spec.moe_strategy, cpu or CpuWorkerSettings(act_quant=spec.cpu_act_quant))
        reclaim_stale_host_memory()
        child = ModelChild(spec, fill_store=spec.moe_strategy in HOST_STORE_STRATEGIES, log_level=log_level,
                           timeout_s=timeout_s)
        try:
            res.model = child.open()
            if child.fill_store:
                res._create(res.model, store_name, lambda store: child.fill(store.name))
            child.close()
        except BaseException:
            child.kill()
            res.close()
            raise
        return res

    @classmethod
    def create(cls, source: Any, strategy: str, *, store_name: str, cpu: CpuWorkerSettings | None = None,
               staging_device: Any = None) -> "ExpertResources":
        """The store (offload, cpu, hybrid) and the CPU workers' channels (cpu, hybrid) for `source`
        (gpu_worker.api.ModelSource), filled in this process; nothing for resident. The workers start with
        cpu_worker_specs()."""
        res = cls(strategy, cpu or CpuWorkerSettings())
        reclaim_stale_host_memory()
        if strategy not in HOST_STORE_STRATEGIES:
            return res
        # lazy: the modes that call this load the model in this process anyway; `ft serve` alone does not
        from ftexpert.gpu_worker.api import fill_expert_store, model_facts

        try:
            res.model = model_facts(source)
            res._create(res.model, store_name, lambda store: fill_expert_store(store, source.experts, staging_device))
        except BaseException:
            res.close()
            raise
        return res

    @classmethod
    def over_store(cls, store: Any, strategy: str, *, top_k: int, model_dtype: Any,
                   cpu: CpuWorkerSettings | None = None) -> "ExpertResources":
        """The CPU workers' channels (cpu, hybrid) over an expert store the caller created and keeps (a benchmark
        that runs several backends over one store); the workers start with cpu_worker_specs / start_cpu_workers."""
        res = cls(strategy, cpu or CpuWorkerSettings())
        res.store_name, res.config_hash = store.name, store.config_hash
        try:
            if strategy in CPU_STRATEGIES:
                res._plan_workers()
                res._create_channels(store.shape.hidden, top_k, model_dtype)
        except BaseException:
            res.close()
            raise
        return res

    def _plan_workers(self) -> tuple[str, list[int]]:
        cpu = self.cpu
        self.num_cpu_workers = cpu.num_workers or cpu_api.default_worker_count()
        allowed = sorted(os.sched_getaffinity(0))        # before anyone in this process pins itself
        reserved = cpu_api.reserved_cpus(cpu.reserve_cpus, allowed)
        self._flags = cpu_api.worker_flags(threads=cpu.threads, reserve_cpus=reserved, allowed_cpus=allowed,
                                           extra=("--log-level", cpu.log_level, "--act-quant", cpu.act_quant,
                                                  *cpu.worker_args))
        return reserved, allowed

    def _create_channels(self, hidden: int, top_k: int, model_dtype: Any) -> None:
        t_max = self.cpu.t_max
        for i in range(self.num_cpu_workers):
            name = channel_name_for(self.store_name, i)
            self.channels.append(create_worker_channel(name, t_max=t_max, hidden=hidden, max_triples=t_max * top_k,
                                                       hidden_dtype=channel_hidden_dtype(model_dtype)))
            self.channel_names.append(name)

    def _create(self, facts: ModelFacts, store_name: str, fill: Callable[[ExpertStore], Any]) -> None:
        """Create the store for `facts`, place its pages (cpu / hybrid), have `fill` write it, then the channels."""
        place = None                         # for cpu/hybrid: expert pages on the NUMA nodes of their workers
        if self.strategy in CPU_STRATEGIES:
            reserved, allowed = self._plan_workers()
            reserved_set = parse_cpulist(reserved)
            place = functools.partial(cpu_api.place_store_for_workers, num_workers=self.num_cpu_workers,
                                      reserved_cpus=reserved_set, allowed_cpus=allowed)
        shape = facts.store_shape
        self.store = ExpertStore.create(store_name, num_layers=shape.num_layers, num_experts=shape.num_experts,
                                        hidden=shape.hidden, intermediate=shape.intermediate, dtype=shape.dtype,
                                        config_hash=facts.config_hash, fmt=shape.fmt, act=shape.act)
        self.store_name, self.config_hash = self.store.name, self.store.config_hash
        if place is not None:
            place(self.store)                # before the fill: pages are placed where they are first written
        t0 = time.perf_counter()
        fill(self.store)
        if not self.store.is_ready:
            raise RuntimeError(f"expert store {store_name!r}: its filler returned without marking it ready")
        log.info("expert store %r filled: %.2f GiB in %.1f s", store_name, self.store.nbytes / 1024 ** 3,
                 time.perf_counter() - t0)
        self._create_channels(facts.hidden_size, facts.top_k, facts.dtype)

    def reserved_cpus(self) -> str:
        """The CPUs the workers keep off (what the GPU-driving process pins itself to)."""
        return cpu_api.reserved_cpus(self.cpu.reserve_cpus)

    def cpu_worker_specs(self) -> list[WorkerSpec]:
        """The supervised `ft worker cpu` children, one per channel."""
        cpu = self.cpu
        return [WorkerSpec(f"cpu{i}", worker_argv(store_name=self.store_name, channel_name=name, worker_index=i,
                                                   num_workers=self.num_cpu_workers, flags=self._flags),
                           self.config_hash, env={"PYTHONPATH": worker_env()["PYTHONPATH"]}, kind="cpu-worker",
                           ready_timeout_s=cpu.ready_timeout_s, heartbeat_timeout_s=cpu.heartbeat_timeout_s,
                           backoff_initial_s=cpu.backoff_initial_s, backoff_max_s=cpu.backoff_max_s,
                           max_restarts=cpu.max_restarts)
                for i, name in enumerate(self.channel_names)]

    def start_cpu_workers(self) -> Supervisor | None:
        """Start the CPU workers under a Supervisor of this owner and wait until each is READY (cpu, hybrid)."""
        specs = self.cpu_worker_specs()
        if not specs:
            return None
        self.supervisor = Supervisor(specs, give_up_advice=self.give_up_advice)
        self.supervisor.start(timeout_s=self.cpu.ready_timeout_s)
        return self.supervisor

    @staticmethod
    def give_up_advice(name: str) -> str:
        """start_cpu_workers' supervisor runs in `ft serve --workers inline` and `ft generate`: no `ft ctl restart`
        reaches it."""
        return (f"then restart the command that runs {name} (`ft serve --workers inline` or `ft generate`): nothing "
                f"restarts it in this process")

    def worker_info(self) -> list[dict[str, Any]]:
        return self.supervisor.worker_info() if self.supervisor is not None else []

    def close(self) -> None:
        if self.supervisor is not None:
            try:
                self.supervisor.stop()
            except Exception:  # noqa: BLE001 - keep tearing down
                log.exception("stopping the CPU workers failed")
            self.supervisor = None
        for seg in self.channels:
            seg.close()
            seg.unlink()
        self.channels, self.channel_names = [], []
        if self.store is not None:
            self.store.close()
            self.store.unlink()                  # the creator: unlinks the store's name
            self.store = None
        self.store_name = self.config_hash = ""
