"""The CPU expert worker process: ``run_cpu_worker`` (entry) and ``cpu_busy_loop`` (hot path).

Start-up, in this order: process checklist (title, die with parent, faulthandler, role logger), CPU and
NUMA binding, then the big things (map the store, HELLO to the supervisor with the store's config hash,
attach the channel, build/load the kernel), warm-up, claim the channel, READY, serve. The settings come
from the command line; the busy loop has no socket code: the supervisor link's SHUTDOWN (or the parent's
end-of-file) and SIGTERM / SIGINT arrive as a stop in its inbox.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

import torch

from ftexpert.cpu_expert_pool.channel import ChannelBusy, IdlePolicy, IdleWaiter, Request, WorkerChannel
from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel, LayerStats, check_split
from ftexpert.cpu_expert_pool.native_loop import SERVE_PYTHON, NativeServeLoop, native_loop_wanted
from ftexpert.cpu_expert_pool.topology import SYSFS_ROOT, WorkerPlacement, bind_current_process, discover_placements
from ftexpert.proto.expert_store import ExpertStore
from ftexpert.proto.sd_notify import process_notifier
from ftexpert.proto.supervised_child import ENV_FD, SupervisorLink
from ftexpert.proto.shm_layout import STATUS_BAD_REQUEST, STATUS_COMPUTE_ERROR, STATUS_OK
from ftexpert.proto.shm_segment import ShmError

log = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000
STORE_READY_POLL_S = 0.05
LOG_EVERY_N_ERRORS = 1000       # after the first few, log one bad request in this many
WARMUP_TOP_K = 8
SUPERVISOR_HEARTBEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """How the worker computes and waits (its `ft worker cpu` flags)."""
    kernel: str = "auto"              # auto | torch | native | native-<isa> (see expert_kernel.KERNELS)
    act_quant: str = "auto"           # auto | fp32 | int8: 4-bit formats' activations (expert_kernel.ACT_QUANTS)
    num_threads: int = 0              # 0 = one per physical core of the placement
    spin_us: float = 50.0             # idle: spin this long between sleeps
    hot_ms: float = 50.0              # after a request: spin continuously this long
    sleep_min_us: float = 20.0        # idle sleeps grow from this ...
    sleep_max_us: float = 1000.0      # ... to this
    heartbeat_interval_ms: float = 1.0

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_ms > 0 or not self.hot_ms >= 0:
            raise ValueError(f"heartbeat_interval_ms={self.heartbeat_interval_ms} must be > 0 and "
                             f"hot_ms={self.hot_ms} >= 0")


class Stop:
    """Inbox item: stop serving (SIGTERM, SIGINT, the supervisor's SHUTDOWN or its end-of-file)."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclasses.dataclass
class WorkerOptions:
    store_name: str
    channel_name: str
    worker_index: int = 0
    num_workers: int = 1
    settings: WorkerSettings = dataclasses.field(default_factory=WorkerSettings)
    reserved_cpus: tuple[int, ...] = ()
    allowed_cpus: tuple[int, ...] | None = None   # placed within these (--allowed-cpus); None: the inherited affinity
    mempolicy: str = "preferred"             # preferred | bind | none
    pin_threads: bool = True
    expect_config_hash: str | None = None
    handshake_timeout_s: float = 30.0
    sysfs_root: str = SYSFS_ROOT
    warmup: bool = True


@dataclasses.dataclass
class WorkerStats:
    requests: int = 0
    tokens: int = 0
    triples: int = 0
    expert_calls: int = 0
    weight_bytes: int = 0
    compute_ns: int = 0
    errors: int = 0
    foreign_triples: int = 0          # the C loop's counter against an owner map (none is given: stays 0)


class CpuWorker:
    """What the busy loop works with: store, channel, kernel, settings, counters."""

    def __init__(self, options: WorkerOptions, placement: WorkerPlacement, store: ExpertStore,
                 channel: WorkerChannel):
        self.options, self.placement, self.store, self.channel = options, placement, store, channel
        self.stats = WorkerStats()
        st = self.settings = options.settings
        num_threads = st.num_threads or placement.num_threads
        self.kernel = ExpertKernel(store, kernel=st.kernel, num_threads=num_threads, act_quant=st.act_quant)
        if options.pin_threads and num_threads == len(placement.compute_cpus):
            pinned = self.kernel.pin_threads(list(placement.compute_cpus))
            log.info("kernel %s, %d threads%s", self.kernel.name, num_threads, ", pinned one per core" if pinned else "")
        self.idle = IdleWaiter(IdlePolicy(hot_s=st.hot_ms / 1e3, spin_s=st.spin_us / 1e6,
                                          sleep_min_s=st.sleep_min_us / 1e6, sleep_max_s=st.sleep_max_us / 1e6))
        self.heartbeat_interval_ns = int(st.heartbeat_interval_ms * 1e6)
        self._loop: NativeServeLoop | None = None       # the C hot loop around the kernel, built on first use
        self._loop_wanted = native_loop_wanted()

    # -- hot path -------------------------------------------------------------------------------
    def native_loop(self) -> NativeServeLoop | None:
        """The C loop around the compiled kernel (None: the torch kernel, or FT_WORKER_LOOP=python)."""
        if self._loop is None and self._loop_wanted:
            self._loop = self.kernel.serve_loop(self.channel, split=None, worker_index=self.options.worker_index)
            if self._loop is None:
                self._loop_wanted = False            # the torch kernel: the Python loop serves
            log.info("hot loop: %s", "C (ft_serve)" if self._loop is not None else "Python")
        return self._loop

    def serve(self, req: Request) -> None:
        t0 = time.perf_counter_ns()
        layer_stats = LayerStats(0, 0)
        try:
            if req.malformed:
                raise ValueError("token or triple count outside the channel's layout")
            check_split(self.store, req.split_expert, req.split_limit)     # a bad split is a bad request
            if req.num_triples == 0:
                req.out.zero_()
            else:
                layer_stats = self.kernel(req.layer, req.hidden, req.token_idx, req.expert_id, req.weight, req.out,
                                          req.split_expert, req.split_limit)
            status = STATUS_OK
        except (ValueError, IndexError) as exc:
            status = STATUS_BAD_REQUEST
            self._log_error("bad request %d (layer %d): %s", req.seq, req.layer, exc)
        except Exception:  # a kernel failure must answer the client, not hang it
            status = STATUS_COMPUTE_ERROR
            self._log_error("compute error in request %d (layer %d)", req.seq, req.layer, exc_info=True)
        compute_ns = time.perf_counter_ns() - t0
        self.channel.complete(req, status, num_experts=layer_stats.num_experts, compute_ns=compute_ns)
        s = self.stats
        s.requests += 1
        s.tokens += req.num_tokens
        s.triples += req.num_triples
        s.expert_calls += layer_stats.num_experts
        s.weight_bytes += layer_stats.weight_bytes
        s.compute_ns += compute_ns

    def _log_error(self, fmt: str, *args: object, exc_info: bool = False) -> None:
        self.stats.errors += 1
        if self.stats.errors <= 10 or self.stats.errors % LOG_EVERY_N_ERRORS == 0:
            log.error(fmt + " (error %d)", *args, self.stats.errors, exc_info=exc_info)

    def warmup(self) -> float:
        """One call over real experts of layer 0; returns weight GB/s (also maps those pages here)."""
        top_k = min(WARMUP_TOP_K, self.store.num_experts)
        hidden = torch.zeros(1, self.store.shape.hidden, dtype=torch.bfloat16)
        token_idx = torch.zeros(top_k, dtype=torch.int32)
        expert_id = torch.arange(top_k, dtype=torch.int32)
        weight = torch.full((top_k,), 1.0 / top_k)
        out = torch.empty(1, self.store.shape.hidden)
        self.kernel(0, hidden, token_idx, expert_id, weight, out)          # first touch, thread start
        t0 = time.perf_counter_ns()
        stats = self.kernel(0, hidden, token_idx, expert_id, weight, out)
        return stats.weight_bytes / max(time.perf_counter_ns() - t0, 1)  # bytes/ns = GB/s


def cpu_busy_loop(worker: CpuWorker, inbox: queue.Queue, watchdog: Callable[[], Any] | None = None) -> None:
    """Serve the channel until a Stop arrives in `inbox`. No sockets here. `watchdog` is called at every
    housekeeping time (systemd's WATCHDOG=1, proto/sd_notify.py: a hung loop stops it).

    With the compiled kernel, requests are answered in C (native_loop.py) until the next housekeeping
    time (heartbeat, the inbox) or an idle stretch; a request C leaves (malformed, a bad split, a
    kernel error) is answered here in Python, as all are with the torch kernel."""
    channel, idle = worker.channel, worker.idle
    next_housekeeping_ns = 0
    while True:
        loop = worker.native_loop()
        code = SERVE_PYTHON
        if loop is not None:
            code, last_ns = loop.run(next_housekeeping_ns, int(idle.policy.hot_s * NS_PER_S), idle.last_work_ns)
            loop.drain_stats(worker.stats)
            if last_ns != idle.last_work_ns:
                idle.worked(last_ns)
        if code == SERVE_PYTHON:
            req = channel.next_request()
            if req is not None:
                worker.serve(req)
                idle.worked(time.monotonic_ns())
                continue
        now_ns = time.monotonic_ns()
        if now_ns >= next_housekeeping_ns:
            channel.beat(now_ns)
            if watchdog is not None:
                watchdog()
            next_housekeeping_ns = now_ns + worker.heartbeat_interval_ns
            if not inbox.empty():
                log.info("stopping: %s", inbox.get_nowait().reason)
                return
        idle.pause(now_ns)                       # returns at once while hot; sleeps once the worker is cold


def _wait_store_ready(store: ExpertStore, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.is_ready:
        if time.monotonic() > deadline:
            raise ShmError(f"expert store {store.name!r} is still being loaded after {timeout_s:.0f} s; start "
                           "CPU workers after the coordinator has loaded it, or raise --handshake-timeout-s")
        time.sleep(STORE_READY_POLL_S)


class SupervisorBridge:
    """When started by coordinator/supervisor.py ($FT_SUPERVISOR_FD set): its HELLO (the store's config
    hash) / READY / heartbeat link, with its SHUTDOWN (or the parent's end-of-file) put into the inbox as a Stop."""

    def __init__(self, inbox: queue.Queue):
        self.link = SupervisorLink.from_env()
        self.inbox = inbox

    def hello(self, config_hash: str, timeout_s: float) -> None:
        self.link.hello(config_hash, timeout_s=timeout_s)

    def ready(self, heartbeat_interval_s: float) -> None:
        self.link.ready()
        self.link.start_background(heartbeat_interval_s)
        threading.Thread(target=self._forward_shutdown, name="supervisor-shutdown", daemon=True).start()

    def _forward_shutdown(self) -> None:
        self.link.shutdown_requested.wait()
        self.inbox.put(Stop("the supervisor asked to stop (or the parent is gone)"))


def plan_placement(options: WorkerOptions) -> WorkerPlacement:
    """This worker's share of the allowed CPUs (options.allowed_cpus, else the affinity it inherited)
    minus the reserved ones. A parent that pinned itself to the reserved CPUs passes its earlier, wider
    affinity: planned over the inherited mask, a restarted worker would find no CPU left."""
    placements = discover_placements(num_workers=options.num_workers, reserved_cpus=options.reserved_cpus,
                                     sysfs_root=options.sysfs_root, allowed_cpus=options.allowed_cpus)
    return placements[options.worker_index]


def run_cpu_worker(options: WorkerOptions) -> int:
    """Entry point of one CPU expert worker (after process_setup). Returns the exit code."""
    inbox: queue.Queue = queue.Queue()
    signal.signal(signal.SIGTERM, lambda *_: inbox.put(Stop("SIGTERM")))
    signal.signal(signal.SIGINT, lambda *_: inbox.put(Stop("SIGINT")))
    supervisor = SupervisorBridge(inbox) if ENV_FD in os.environ else None
    notifier = process_notifier()             # systemd (ft-cpu-worker@.service): READY=1, STATUS=, WATCHDOG=1
    notifier.status(f"attaching the expert store {options.store_name}")
    store = channel = None
    try:
        placement = plan_placement(options)
        log.info("%s", placement.describe())
        bind_current_process(placement, mempolicy=options.mempolicy)

        store = ExpertStore.attach(options.store_name, readonly=True)
        if options.expect_config_hash is not None and store.config_hash != options.expect_config_hash:
            raise ShmError(f"expert store {store.name!r} has config hash {store.config_hash!r}, expected "
                           f"{options.expect_config_hash!r}: it holds another model or settings; restart the "
                           "coordinator so it reloads the store")
        if supervisor is not None:
            supervisor.hello(store.config_hash, options.handshake_timeout_s)
        _wait_store_ready(store, options.handshake_timeout_s)
        channel = WorkerChannel(options.channel_name)
        if channel.layout.hidden != store.shape.hidden:
            raise ShmError(f"channel {channel.name!r} has H={channel.layout.hidden}, the store H="
                           f"{store.shape.hidden}; recreate the channel for this model")
        worker = CpuWorker(options, placement, store, channel)
        warmup_gbps = worker.warmup() if options.warmup else 0.0
        channel.start()
        channel.serve()
        if supervisor is not None:
            supervisor.ready(SUPERVISOR_HEARTBEAT_S)
        log.info("serving channel %r (epoch %d), kernel %s, warm-up %.1f GB/s", channel.name, channel.epoch,
                 worker.kernel.name, warmup_gbps)
        notifier.ready(f"serving channel {channel.name} (kernel {worker.kernel.name})")
        cpu_busy_loop(worker, inbox, watchdog=notifier.watchdog)
        notifier.stopping()
        return 0
    except (ShmError, ChannelBusy, ValueError, RuntimeError, TimeoutError, IndexError) as exc:
        log.error("%s", exc)
        return 2
    finally:
        if channel is not None:
            channel.stop()                      # only if this process claimed it
            channel.close()
        if store is not None:
            store.close()
