"""The CPU expert worker process: ``run_cpu_worker`` (entry), ``cpu_busy_loop`` (hot path), ``ControlLink``.

Start-up, in this order: process checklist (title, die with parent, faulthandler, role logger), CPU and
NUMA binding, then the big things (map the store, attach the channel, build/load the kernel), HELLO,
wait for CONFIG, warm-up, claim the channel, READY, serve. The busy loop has no socket code: the
ControlLink IO thread turns ZMQ frames into inbox items and sends what the loop puts in the outbox.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time

import torch

from cpu_expert_pool.channel import ChannelBusy, IdlePolicy, IdleWaiter, Request, WorkerChannel
from cpu_expert_pool.expert_kernel import ExpertKernel, LayerStats, check_split
from cpu_expert_pool.native_loop import SERVE_PYTHON, NativeServeLoop, native_loop_wanted
from cpu_expert_pool.native.build import ISA_NAMES, try_load_native
from proto.expert_owners import ExpertSplit
from cpu_expert_pool.topology import SYSFS_ROOT, WorkerPlacement, bind_current_process, discover_placements
from proto import messages as m
from proto.expert_store import ExpertStore
from proto.shm_layout import STATUS_BAD_REQUEST, STATUS_COMPUTE_ERROR, STATUS_OK
from proto.shm_segment import ShmError

log = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000
IO_POLL_MS = 10                 # ControlLink: how often it looks at the outbox when no frame arrives
LINGER_MS = 1000                # ControlLink: how long unsent control messages may delay exit
STORE_READY_POLL_S = 0.05
LOG_EVERY_N_ERRORS = 1000       # after the first few, log one bad request in this many
WARMUP_TOP_K = 8
SUPERVISOR_FD_ENV = "FT_SUPERVISOR_FD"   # proto/supervised_child.py's link, when it started us
SUPERVISOR_HEARTBEAT_S = 1.0


@dataclasses.dataclass
class WorkerOptions:
    store_name: str
    channel_name: str
    worker_index: int = 0
    num_workers: int = 1
    control_addr: str | None = None          # ZMQ address of the coordinator's ROUTER; None = standalone
    config: m.Config = dataclasses.field(default_factory=m.Config)   # settings until CONFIG says otherwise
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
    foreign_triples: int = 0


class ControlLink(threading.Thread):
    """IO thread: DEALER socket to the coordinator. Frames in -> inbox; outbox -> frames out."""

    def __init__(self, addr: str, inbox: queue.Queue, outbox: queue.Queue, identity: bytes):
        super().__init__(name="control-io", daemon=True)
        self.addr, self.inbox, self.outbox, self.identity = addr, inbox, outbox, identity
        self._stop_event = threading.Event()

    def run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.connect(self.addr)
        try:
            while True:
                while True:                      # send everything queued
                    try:
                        msg = self.outbox.get_nowait()
                    except queue.Empty:
                        break
                    sock.send_multipart(m.encode(msg))
                if self._stop_event.is_set():
                    return
                if sock.poll(IO_POLL_MS, zmq.POLLIN):
                    frames = sock.recv_multipart()
                    try:
                        self.inbox.put(m.decode(frames))
                    except m.MessageError as exc:
                        log.error("dropping a malformed control message: %s", exc)
        finally:
            sock.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=LINGER_MS / 1000 + 1)


class CpuWorker:
    """What the busy loop works with: store, channel, kernel, split, settings, counters."""

    def __init__(self, options: WorkerOptions, placement: WorkerPlacement, store: ExpertStore,
                 channel: WorkerChannel, outbox: queue.Queue):
        self.options, self.placement, self.store, self.channel, self.outbox = options, placement, store, channel, outbox
        self.stats = WorkerStats()
        self.started_s = time.monotonic()
        self.config = options.config
        self.kernel: ExpertKernel | None = None
        self.split: ExpertSplit | None = None
        self.split_epoch = 0
        self.idle = IdleWaiter(self._policy(self.config))
        self.heartbeat_interval_ns = int(self.config.heartbeat_interval_ms * 1e6)
        self.apply_config(self.config)                  # also sets _loop (the C hot loop) and _loop_wanted

    @staticmethod
    def _policy(config: m.Config) -> IdlePolicy:
        return IdlePolicy(hot_s=config.hot_ms / 1e3, spin_s=config.spin_us / 1e6,
                          sleep_min_s=config.sleep_min_us / 1e6, sleep_max_s=config.sleep_max_us / 1e6)

    # -- control --------------------------------------------------------------------------------
    def apply_config(self, config: m.Config) -> None:
        if not config.heartbeat_interval_ms > 0 or not config.hot_ms >= 0:
            raise ValueError(f"heartbeat_interval_ms={config.heartbeat_interval_ms} must be > 0 and "
                             f"hot_ms={config.hot_ms} >= 0")
        num_threads = config.num_threads or self.placement.num_threads
        if self.kernel is None or config.kernel != self.config.kernel or num_threads != self.kernel.num_threads:
            self.kernel = ExpertKernel(self.store, kernel=config.kernel, num_threads=num_threads)
            if self.options.pin_threads and num_threads == len(self.placement.compute_cpus):
                pinned = self.kernel.pin_threads(list(self.placement.compute_cpus))
                log.info("kernel %s, %d threads%s", self.kernel.name, num_threads,
                         ", pinned one per core" if pinned else "")
        self.config = config
        self._loop: NativeServeLoop | None = None       # the C hot loop, rebuilt around the (new) kernel on use
        self._loop_wanted = native_loop_wanted()
        self.idle.policy = self._policy(config)
        self.heartbeat_interval_ns = int(config.heartbeat_interval_ms * 1e6)
        if config.owner_map:
            self.set_split(config.split_epoch, config.owner_map)

    def set_split(self, epoch: int, owner_map: bytes) -> None:
        self.split = ExpertSplit.from_bytes(owner_map, self.store.num_layers, self.store.num_experts,
                                            self.options.num_workers)
        self.split_epoch = epoch
        self._loop = None                                # rebuilt with the new owner map
        log.info("expert split epoch %d: this worker owns %d (layer, expert) pairs", epoch,
                 self.split.num_owned(self.options.worker_index))

    def handle(self, msg: m.Message) -> bool:
        """Apply one control message; False means stop serving."""
        if isinstance(msg, m.Shutdown):
            log.info("shutdown requested%s", f": {msg.reason}" if msg.reason else "")
            return False
        if isinstance(msg, m.StatsRequest):
            self.outbox.put(self.stats_message())
        elif isinstance(msg, m.Rebalance):
            try:
                self.set_split(msg.split_epoch, msg.owner_map)
                self.outbox.put(m.Rebalanced(self.options.worker_index, self.split_epoch,
                                             self.split.num_owned(self.options.worker_index)))
            except ValueError as exc:
                self.outbox.put(m.Error(self.options.worker_index, f"REBALANCE refused: {exc}", fatal=False))
        elif isinstance(msg, m.Config):
            try:
                self.apply_config(msg)
                self.outbox.put(self.ready_message(warmup_gbps=0.0))
            except (ValueError, RuntimeError) as exc:
                self.outbox.put(m.Error(self.options.worker_index, f"CONFIG refused: {exc}", fatal=False))
        else:
            log.warning("ignoring unexpected control message %s", type(msg).__name__)
        return True

    def stats_message(self) -> m.Stats:
        s = self.stats
        return m.Stats(self.options.worker_index, s.requests, s.tokens, s.triples, s.expert_calls, s.weight_bytes,
                       s.compute_ns, s.errors, s.foreign_triples, self.split_epoch,
                       time.monotonic() - self.started_s)

    def ready_message(self, warmup_gbps: float) -> m.Ready:
        assert self.kernel is not None
        return m.Ready(self.options.worker_index, os.getpid(), self.store.config_hash, self.kernel.name,
                       self.kernel.num_threads, warmup_gbps, self.split_epoch, self.channel.epoch)

    # -- hot path -------------------------------------------------------------------------------
    def native_loop(self) -> NativeServeLoop | None:
        """The C loop around the compiled kernel (None: the torch kernel, or FT_WORKER_LOOP=python)."""
        if self._loop is None and self._loop_wanted:
            assert self.kernel is not None
            self._loop = self.kernel.serve_loop(self.channel, split=self.split,
                                                worker_index=self.options.worker_index)
            if self._loop is None:
                self._loop_wanted = False            # the torch kernel: the Python loop serves
            log.info("hot loop: %s", "C (ft_serve)" if self._loop is not None else "Python")
        return self._loop

    def serve(self, req: Request) -> None:
        assert self.kernel is not None
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
        if self.split is not None and status == STATUS_OK and req.num_triples:
            s.foreign_triples += self.split.foreign_count(req.layer, req.expert_id.numpy(),
                                                          self.options.worker_index)

    def _log_error(self, fmt: str, *args: object, exc_info: bool = False) -> None:
        self.stats.errors += 1
        if self.stats.errors <= 10 or self.stats.errors % LOG_EVERY_N_ERRORS == 0:
            log.error(fmt + " (error %d)", *args, self.stats.errors, exc_info=exc_info)

    def warmup(self) -> float:
        """One call over real experts of layer 0; returns weight GB/s (also maps those pages here)."""
        assert self.kernel is not None
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


def cpu_busy_loop(worker: CpuWorker, inbox: queue.Queue) -> None:
    """Serve the channel until a Shutdown arrives. No sockets here: control arrives through `inbox`.

    With the compiled kernel, requests are answered in C (native_loop.py) until the next housekeeping
    time (heartbeat, control messages) or an idle stretch; a request C leaves (malformed, a bad split, a
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
            next_housekeeping_ns = now_ns + worker.heartbeat_interval_ns
            while not inbox.empty():
                if not worker.handle(inbox.get_nowait()):
                    return
        idle.pause(now_ns)                       # returns at once while hot; sleeps once the worker is cold


def _wait_store_ready(store: ExpertStore, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.is_ready:
        if time.monotonic() > deadline:
            raise ShmError(f"expert store {store.name!r} is still being loaded after {timeout_s:.0f} s; start "
                           "CPU workers after the coordinator has loaded it, or raise --handshake-timeout-s")
        time.sleep(STORE_READY_POLL_S)


def _wait_config(inbox: queue.Queue, timeout_s: float) -> m.Config | None:
    """The first CONFIG (None on SHUTDOWN); other messages before it are kept for the busy loop."""
    deadline = time.monotonic() + timeout_s
    early: list[m.Message] = []
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no CONFIG from the coordinator within {timeout_s:.0f} s of HELLO; check "
                                   "--control and that the coordinator runs")
            try:
                msg = inbox.get(timeout=remaining)
            except queue.Empty:
                continue
            if isinstance(msg, m.Config):
                return msg
            if isinstance(msg, m.Shutdown):
                log.info("shutdown before CONFIG%s", f": {msg.reason}" if msg.reason else "")
                return None
            early.append(msg)
    finally:
        for msg in early:
            inbox.put(msg)


class SupervisorBridge:
    """When started by coordinator/supervisor.py ($FT_SUPERVISOR_FD set): its HELLO (the store's config
    hash) / READY / heartbeat link, with its SHUTDOWN (or the parent's end-of-file) put into the inbox."""

    def __init__(self, inbox: queue.Queue):
        from proto.supervised_child import SupervisorLink

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
        self.inbox.put(m.Shutdown("supervisor"))


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
    outbox: queue.Queue = queue.Queue()
    signal.signal(signal.SIGTERM, lambda *_: inbox.put(m.Shutdown("SIGTERM")))
    signal.signal(signal.SIGINT, lambda *_: inbox.put(m.Shutdown("SIGINT")))
    link: ControlLink | None = None
    if options.control_addr:
        link = ControlLink(options.control_addr, inbox, outbox, f"cpu{options.worker_index}-{os.getpid()}".encode())
        link.start()
    supervisor = SupervisorBridge(inbox) if SUPERVISOR_FD_ENV in os.environ else None
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
        worker = CpuWorker(options, placement, store, channel, outbox)
        config = options.config
        if link is not None:
            native, _ = try_load_native()
            outbox.put(m.Hello(options.worker_index, options.num_workers, os.getpid(), m.PROTOCOL_VERSION,
                               store.name, store.config_hash, channel.name, placement.node_id,
                               list(placement.cpus), list(placement.compute_cpus), _cpu_features(),
                               ISA_NAMES[native.best_isa] if native else ""))
            received = _wait_config(inbox, options.handshake_timeout_s)
            if received is None:
                return 0
            config = received
            worker.apply_config(config)
        warmup_gbps = worker.warmup() if options.warmup else 0.0
        channel.start()
        channel.serve()
        outbox.put(worker.ready_message(warmup_gbps))
        if supervisor is not None:
            supervisor.ready(SUPERVISOR_HEARTBEAT_S)
        log.info("serving channel %r (epoch %d), kernel %s, warm-up %.1f GB/s", channel.name, channel.epoch,
                 worker.kernel.name if worker.kernel else "?", warmup_gbps)
        cpu_busy_loop(worker, inbox)
        return 0
    except (ShmError, ChannelBusy, ValueError, RuntimeError, TimeoutError, IndexError) as exc:
        log.error("%s", exc)
        outbox.put(m.Error(options.worker_index, str(exc), fatal=True))
        return 2
    finally:
        if channel is not None:
            channel.stop()                      # only if this process claimed it
            channel.close()
        if store is not None:
            store.close()
        if link is not None:
            link.stop()


def _cpu_features() -> list[str]:
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in flags]
    except OSError:
        pass
    return []


if __name__ == "__main__":        # `python -m cpu_expert_pool.worker ...` = `ft worker cpu ...`
    import sys

    from cpu_expert_pool.cli import main

    sys.exit(main())
