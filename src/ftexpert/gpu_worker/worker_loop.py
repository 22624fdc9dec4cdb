"""`gpu_busy_loop`: the GPU worker's engine loop. No socket code: requests arrive as inbox items, outputs
leave through `send`. In a GPU worker process the link's IO thread fills the inbox and takes what is sent
(gpu_worker/worker_link.py); with `ft serve --workers inline` the same loop runs in a thread of the
coordinator, fed by its event loop (coordinator/inline_engine.py).

Each turn: take what the inbox holds (block up to IDLE_WAIT_S only when the engine is idle), run one
`engine.step()`, send its tokens as one TOKEN_BATCH, and every STATS_INTERVAL_S the engine's counters.
It returns an exit code: 0 after SHUTDOWN (or a SIGTERM drain), EXIT_COORDINATOR_LOST when the
coordinator went silent, EXIT_ENGINE_FAILED after MAX_STEP_FAILURES failed steps in a row (a fresh
process is the cure for a broken device context; the supervisor or systemd starts one).
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

from ftexpert.proto import engine_messages as em
from ftexpert.proto.sampling_params import SamplingParams

from ftexpert.gpu_worker.worker_link import CoordinatorLost

log = logging.getLogger("ft.gpu_worker.loop")

IDLE_WAIT_S = 0.05                  # longest block on an empty inbox while the engine is idle
MAX_ITEMS_PER_TURN = 10_000         # inbox items handled between two steps
MAX_STEP_FAILURES = 3               # failed steps in a row before the process gives up
EXIT_ENGINE_FAILED = 3
EXIT_COORDINATOR_LOST = 75          # EX_TEMPFAIL: start again (systemd Restart=) and say HELLO anew


@dataclass(frozen=True)
class LocalStop:
    """From this process: a signal (drain=True: finish the requests first) or the supervisor's SHUTDOWN."""
    reason: str
    drain: bool


class StepEngine(Protocol):
    """What the loop drives: gpu_worker.engine.Engine, or a test's stand-in."""
    stats: Any                                   # flattened into STATS (a dataclass or dict of counters)
    scheduler: Any                               # its `running` and `waiting` requests are the queue depths

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: Hashable) -> Hashable: ...
    def abort(self, request_id: Hashable) -> bool: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[tuple]: ...           # (request id, token id, finished, finish reason[, logprobs]) each
    def set_policy(self, **fields: Any) -> None: ...


def engine_stats(engine: StepEngine) -> tuple[list[str], list[float]]:
    """The engine's counters as parallel (dotted name, value) lists, plus queue depths."""
    flat = em.flatten_stats(engine.stats)
    flat["num_running"] = float(len(engine.scheduler.running))
    flat["num_waiting"] = float(len(engine.scheduler.waiting))
    return list(flat), list(flat.values())


class _Loop:
    def __init__(self, engine: StepEngine, send: Callable[[Any], None], drain_timeout_s: float):
        self.engine, self.send, self.drain_timeout_s = engine, send, drain_timeout_s
        self.live: set[int] = set()
        self.steps = 0
        self.finished = 0
        self.drain_deadline: float | None = None
        self.exit_after_drain = False
        self.stats_dirty = True

    def handle(self, item: Any) -> int | None:
        """Apply one inbox item; an int means: stop with this exit code."""
        engine = self.engine
        if isinstance(item, em.AddRequest):
            if self.drain_deadline is not None:
                self.send(em.RequestFailed(item.request_id, "the GPU worker is draining and accepts no new "
                                                            "requests; retry against another replica", retryable=True))
                return None
            try:
                engine.add_request(em.unpack_token_ids(item.prompt_ids), item.params, request_id=item.request_id)
            except ValueError as exc:            # em.MessageError is one
                self.send(em.RequestFailed(item.request_id, f"the engine refused the request: {exc}"))
                return None
            self.live.add(item.request_id)
        elif isinstance(item, em.Abort):
            for rid in item.request_ids:
                if rid in self.live:
                    self.live.discard(rid)
                    engine.abort(rid)
        elif isinstance(item, em.SetPolicy):
            engine.set_policy(**item.fields())
        elif isinstance(item, em.Drain):
            self.drain_deadline = time.monotonic() + max(0.0, item.timeout_s)
        elif isinstance(item, em.Shutdown):
            log.info("SHUTDOWN from the coordinator%s", f": {item.reason}" if item.reason else "")
            return 0
        elif isinstance(item, LocalStop):
            if not item.drain:
                log.info("stopping: %s", item.reason)
                return 0
            log.info("%s: draining for up to %.0f s", item.reason, self.drain_timeout_s)
            self.exit_after_drain = True
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
        elif isinstance(item, CoordinatorLost):
            log.error("%s; stopping so that a fresh worker says HELLO to the next one", item.reason)
            return EXIT_COORDINATOR_LOST
        else:
            log.debug("ignoring %s", type(item).__name__)
        return None

    def fail_live(self, message: str, retryable: bool = False) -> int:
        failed = sorted(self.live)
        for rid in failed:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the coordinator still hears of it
                pass
            self.send(em.RequestFailed(rid, message, retryable))
        self.live.clear()
        return len(failed)

    def step(self) -> None:
        outputs = self.engine.step()
        self.stats_dirty = True
        if not outputs:
            return
        self.steps += 1
        rids, tokens, finished, reasons, logprobs = [], [], [], [], []
        for out in outputs:
            rid, token, done, reason = out[0], out[1], bool(out[2]), out[3]
            rids.append(int(rid))
            tokens.append(int(token))
            finished.append(done)
            reasons.append(reason or "")
            logprobs.append(out[4] if len(out) > 4 else None)
            if done:
                self.live.discard(rid)
                self.finished += 1
        self.send(em.token_batch(self.steps, rids, tokens, finished, reasons, logprobs))


def gpu_busy_loop(engine: StepEngine, inbox: queue.SimpleQueue, send: Callable[[Any], None], *,
                  drain_timeout_s: float = 30.0, stats_interval_s: float = em.STATS_INTERVAL_S,
                  watchdog: Callable[[], Any] | None = None) -> int:
    """Serve until SHUTDOWN / a drain ends / the coordinator is lost; returns the exit code. `watchdog` is
    called on every turn (systemd's WATCHDOG=1, proto/sd_notify.py: a step that hangs stops it)."""
    loop = _Loop(engine, send, drain_timeout_s)
    failures_in_row = 0
    last_stats = 0.0
    while True:
        if watchdog is not None:
            watchdog()
        busy = engine.has_work()
        try:
            item = inbox.get_nowait() if busy else inbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            item = None
        for _ in range(MAX_ITEMS_PER_TURN):
            if item is None:
                break
            code = loop.handle(item)
            loop.stats_dirty = True                # queue depths changed (an add, an abort)
            if code is not None:
                loop.fail_live("the GPU worker is stopping; retry the request", retryable=True)
                return code
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                item = None
        if engine.has_work():
            try:
                loop.step()
                failures_in_row = 0
            except Exception as exc:  # noqa: BLE001 - one bad step fails its requests, not the process
                failures_in_row += 1
                log.exception("engine.step() failed (%d in a row)", failures_in_row)
                loop.fail_live(f"engine step failed on the GPU worker: {type(exc).__name__}: {exc}")
                if failures_in_row >= MAX_STEP_FAILURES:
                    send(em.Error(f"{failures_in_row} engine steps failed in a row ({exc}); the GPU worker exits "
                                  f"so that a fresh process takes over", fatal=True))
                    return EXIT_ENGINE_FAILED
        now = time.monotonic()
        if loop.stats_dirty and now - last_stats >= stats_interval_s:
            last_stats = now
            loop.stats_dirty = False
            send(em.Stats(*engine_stats(engine)))
        if loop.drain_deadline is not None and (not engine.has_work() or now >= loop.drain_deadline):
            aborted = loop.fail_live("the GPU worker drained and stopped waiting for this request; retry it",
                                    retryable=True)
            send(em.Drained(loop.finished, aborted))
            loop.drain_deadline = None
            if loop.exit_after_drain:
                return 0
