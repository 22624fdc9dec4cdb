"""The engine behind the front doors: one thread owns the engine; requests reach it through a queue.

The engine is single-threaded (only its thread calls add_request / step / abort / stats). The
asyncio side (HTTP, and gRPC through `run_coroutine_threadsafe`) calls `submit()` and iterates the
returned RequestStream; the engine thread feeds each stream's queue through `call_soon_threadsafe`,
batched one callback per step. A stream turns token ids into text (incremental detokenizer, stop
strings). Aborts (client gone, stop string met, drain timeout) travel back as queue items.

Engine contract (gpu_worker.engine): add_request(prompt_ids, params) -> rid;
step() -> [(rid, token_id, finished, finish_reason)]; abort(rid); has_work(); stats.
Optional: set_policy(**fields) receives the fetch policy whenever it changes; a step output may carry a
fifth element, an error (str or EngineError) that fails that one request; `healthy` (bool), `kind`, `pid`
and `restart_worker()` describe an engine that lives in another process (coordinator/remote_engine.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from coordinator.detokenizer import IncrementalDetokenizer, StopStringMatcher
from coordinator.policy import FetchPolicy, StepTelemetry

log = logging.getLogger("ft.coordinator.engine")

IDLE_WAIT_S = 0.05                 # engine thread: longest block on an empty inbox
STATS_INTERVAL_S = 0.1             # engine thread: how often engine.stats is copied out
ERROR_STREAK_UNHEALTHY = 1         # failed steps in a row that mark the engine not serving
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_PENDING_REQUESTS = 512

FINISH_REASONS = {"stop": "stop", "eos": "stop", "stop_token": "stop", "length": "length",
                  "max_tokens": "length", "abort": "abort", "aborted": "abort"}


class ServiceUnavailable(Exception):
    """Not accepting requests (draining, stopped, too many pending). HTTP 503 / gRPC UNAVAILABLE."""


class EngineError(Exception):
    """The engine failed this request (step raised, engine restarted). HTTP 500 / gRPC INTERNAL."""


class EngineUnavailable(EngineError):
    """The engine process is gone or not READY yet (it is being restarted). HTTP 503 / gRPC UNAVAILABLE."""


class RequestTimeout(Exception):
    """The request outlived its deadline and was aborted."""


@dataclass(frozen=True)
class Sampling:
    """What the front doors pass; turned into the engine's SamplingParams in the engine thread."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


def default_params_factory() -> Callable[..., Any]:
    """The engine's SamplingParams if the engine package is there, else a plain stand-in."""
    try:
        from gpu_worker.api import SamplingParams  # type: ignore[attr-defined]
        return SamplingParams
    except ImportError:
        return lambda **kw: Sampling(**kw)


def flatten_stats(obj: Any, prefix: str = "", out: dict[str, float] | None = None, depth: int = 0) -> dict[str, float]:
    """Every finite number in a stats object (dict / dataclass / attributes), as dotted names."""
    out = {} if out is None else out
    if depth > 4:
        return out
    if isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, (int, float)):
        if math.isfinite(obj):
            out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten_stats(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flatten_stats(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name, out, depth + 1)
    elif hasattr(obj, "__dict__") and not callable(obj):
        for k, v in vars(obj).items():
            if not k.startswith("_"):
                flatten_stats(v, f"{prefix}.{k}" if prefix else k, out, depth + 1)
    elif hasattr(obj, "item") and callable(obj.item):  # 0-d tensor / numpy scalar
        try:
            flatten_stats(obj.item(), prefix, out, depth + 1)
        except (TypeError, ValueError, RuntimeError):
            pass
    return out


def telemetry_from_stats(prev: dict[str, float], cur: dict[str, float]) -> StepTelemetry | None:
    """Policy telemetry from two engine stats snapshots (cumulative counters; see docs/CONTROL_PLANE.md)."""
    def delta(key: str) -> float:
        return cur.get(key, 0.0) - prev.get(key, 0.0)

    cpu_experts, cpu_time = {}, {}
    for key in cur:
        if key.startswith("cpu_workers.") and key.endswith(".experts_total"):
            name = key[len("cpu_workers."):-len(".experts_total")]
            cpu_experts[name] = int(delta(key))
            cpu_time[name] = delta(f"cpu_workers.{name}.time_s_total")
    if not cpu_experts and "cpu_experts_total" in cur:
        cpu_experts["cpu"] = int(delta("cpu_experts_total"))
        cpu_time["cpu"] = delta("cpu_expert_time_s_total")
    t = StepTelemetry(experts_fetched=int(delta("experts_fetched_total")), copy_time_s=delta("copy_time_s_total"),
                      cpu_experts=cpu_experts, cpu_time_s=cpu_time,
                      # waits whose copy-side counterpart was not measured would bias the tuner one way;
                      # clamped at 0: the two sums round differently, and a tiny negative would drop the step
                      gpu_wait_for_cpu_s=max(0.0, delta("gpu_wait_for_cpu_s_total")
                                             - delta("gpu_wait_for_cpu_unpaired_s_total")),
                      gpu_wait_for_copy_s=delta("gpu_wait_for_copy_s_total"))
    if t.experts_fetched <= 0 and not any(v > 0 for v in cpu_experts.values()) \
            and t.gpu_wait_for_cpu_s <= 0 and t.gpu_wait_for_copy_s <= 0:
        return None
    return t


class RequestStream:
    """One generation; lives on the event loop. Iterate `chunks()`; call `abort()` when the client goes."""

    def __init__(self, service: "EngineService", prompt_ids: Sequence[int], sampling: Sampling,
                 stop: Sequence[str], deadline_s: float):
        self.id = uuid.uuid4().hex
        self.service = service
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.prompt_tokens = len(self.prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.done = False                      # no more events will come
        self.created_at = time.monotonic()
        self.first_token_at: float | None = None
        self._deadline = self.created_at + deadline_s
        self._events: asyncio.Queue = asyncio.Queue()
        self._detok = IncrementalDetokenizer(service.decode, self.prompt_ids)
        self._stops = StopStringMatcher(stop)
        self._released = False

    # -- called on the loop by the service --
    def _deliver(self, token_id: int | None, finished: bool, reason: str | None,
                 error: str | EngineError | None = None) -> None:
        """An event from the engine thread (or a local terminal event); ignored once terminal."""
        if self.done:
            return
        if finished or error is not None:
            self.done = True
        self._events.put_nowait((token_id, finished, reason, error))

    def _release_engine(self) -> None:
        """Ask the engine thread to abort this request (frees its slots); no event for the consumer."""
        if not self._released:
            self._released = True
            self.service._send(("abort", self))

    def abort(self, error: str | None = None) -> None:
        """Free the engine's slots for this request and end its stream (idempotent).

        With `error`, a consumer still reading gets EngineError(error); else finish_reason 'abort'."""
        if self.done:
            return
        self._release_engine()
        self.service.requests_aborted_total += 1
        self._deliver(None, True, "abort", error)

    def close(self) -> None:
        """The consumer is done with this stream (whether or not it read it): abort if unfinished."""
        if not self.done:
            self.abort()
        self.service._forget(self)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Text pieces as they decode; the last has finished=True. Raises EngineError / RequestTimeout."""
        try:
            while True:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeout(f"request exceeded its {self._deadline - self.created_at:.0f} s limit "
                                         f"and was aborted; ask for fewer tokens or raise --request-timeout-s")
                try:
                    token_id, finished, reason, error = await asyncio.wait_for(self._events.get(), remaining)
                except asyncio.TimeoutError:
                    continue
                if error is not None:
                    self.done = True
                    raise error if isinstance(error, EngineError) else EngineError(error)
                text, ids = "", []
                if token_id is not None:
                    ids.append(token_id)
                    self.completion_tokens += 1
                    if self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                    stop_ids = self.sampling.stop_token_ids
                    if not (finished and token_id in stop_ids):  # the stop token's text is not shown
                        text = self._stops.feed(self._detok.add(token_id))
                if self._stops.stopped:
                    if not self.done:
                        self._release_engine()   # the engine would go on: free its slots now
                        self.done = True
                    self.finish_reason = "stop"
                    self.service._finished(self, "stop")
                    yield Chunk(text, ids, True, "stop")
                    return
                if finished:
                    text += self._stops.feed(self._detok.flush())
                    if self._stops.stopped:
                        reason = "stop"
                    else:
                        text += self._stops.flush()
                    self.finish_reason = FINISH_REASONS.get(str(reason), str(reason or "stop"))
                    self.service._finished(self, self.finish_reason)
                    yield Chunk(text, ids, True, self.finish_reason)
                    return
                if text or ids:
                    yield Chunk(text, ids)
        finally:
            self.close()               # consumer left early (client gone, cancelled): free the slots


class EngineService:
    """Runs `engine_factory()`'s engine in one thread; fans its tokens out to RequestStreams."""

    def __init__(self, engine_factory: Callable[[], Any], decode: Callable[[Sequence[int]], str], *,
                 policy: FetchPolicy | None = None, params_factory: Callable[..., Any] | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS):
        self._engine_factory = engine_factory
        self.decode = decode
        self.policy = policy
        self._params_factory = params_factory or default_params_factory()
        self.request_timeout_s = request_timeout_s
        self.max_pending_requests = max_pending_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine: Any = None
        self.started_at = time.monotonic()
        self.draining = False
        self.stopped = False
        # counters (written on the loop unless noted)
        self.live: set[RequestStream] = set()
        self.requests_total = 0
        self.requests_failed_total = 0        # engine thread
        self.requests_aborted_total = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0       # engine thread
        self.finished_by_reason: dict[str, int] = {}
        self.restarts = 0
        self.engine_healthy = False
        self.last_error = ""
        self.engine_stats: dict[str, float] = {}
        self._recent_tokens: collections.deque = collections.deque()  # (time, tokens) per step, last 10 s
        self._idle = asyncio.Event()
        self._admitted = 0                    # engine thread: requests inside the engine

    # ---------------------------------------------------------------- lifecycle (event loop side)

    async def start(self, timeout_s: float = 600.0) -> None:
        """Build the engine in its thread (first use may compile) and start the busy loop."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._engine_thread_main, args=(ready,), name="ft-engine",
                                        daemon=True)
        self._thread.start()
        await asyncio.wait_for(ready, timeout_s)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped = self.draining = True
        for s in list(self.live):
            s._deliver(None, False, None, "the server is shutting down")
        self._send(("stop", None))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    # ---------------------------------------------------------------- requests (event loop side)

    def submit(self, prompt_ids: Sequence[int], sampling: Sampling, stop: Sequence[str] = ()) -> RequestStream:
        if self.stopped:
            raise ServiceUnavailable("the server is shutting down; retry against another replica")
        if self.draining:
            raise ServiceUnavailable("the server is draining and accepts no new requests; retry later "
                                     "or against another replica")
        if len(self.live) >= self.max_pending_requests:
            raise ServiceUnavailable(f"too many requests in flight ({len(self.live)}); retry shortly")
        stream = RequestStream(self, prompt_ids, sampling, stop, self.request_timeout_s)
        self.live.add(stream)
        self._idle.clear()
        self.requests_total += 1
        self.prompt_tokens_total += stream.prompt_tokens
        self._send(("add", stream))
        return stream

    def _send(self, item: tuple) -> None:
        self._inbox.put(item)

    def _finished(self, stream: RequestStream, reason: str) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def _forget(self, stream: RequestStream) -> None:
        self.live.discard(stream)
        if not self.live:
            self._idle.set()

    async def drain(self, timeout_s: float) -> tuple[int, int]:
        """Stop accepting; wait up to timeout_s for requests in flight; abort the rest.

        Returns (finished while waiting, aborted)."""
        self.draining = True
        before = len(self.live)
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        left = [s for s in self.live if not s.done]
        for s in left:
            s.abort(f"aborted: the server drained and stopped waiting after {timeout_s:g} s")
        return before - len(left), len(left)

    def resume(self) -> None:
        if not self.stopped:
            self.draining = False

    async def call_in_engine_thread(self, fn: Callable[[Any], Any], timeout_s: float = 60.0) -> Any:
        """Run fn(engine) on the engine thread (the only thread that may touch the engine)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(("call", (fn, fut)))
        return await asyncio.wait_for(fut, timeout_s)

    async def restart_engine(self) -> None:
        """Fail the requests in flight and build a fresh engine from the factory (an engine in another
        process restarts that process instead)."""
        def rebuild(engine):
            self._fail_all("the engine was restarted by an operator; retry the request")
            if hasattr(engine, "restart_worker"):
                engine.restart_worker()
                self.restarts += 1
                return
            self.engine = None
            self.engine_healthy = False
            self.engine = self._engine_factory()
            self.restarts += 1
            self.engine_healthy = True
            self._push_policy()
        await self.call_in_engine_thread(rebuild, timeout_s=600.0)

    # ---------------------------------------------------------------- figures

    @property
    def requests_waiting(self) -> int:
        waiting = self.engine_stats.get("num_waiting", self.engine_stats.get("requests_waiting"))
        if waiting is not None:
            return int(waiting)
        return max(0, len(self.live) - self._admitted)

    @property
    def requests_running(self) -> int:
        running = self.engine_stats.get("num_running", self.engine_stats.get("requests_running"))
        return int(running) if running is not None else min(self._admitted, len(self.live))

    def tokens_per_s(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent_tokens) if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else window_s
        return sum(n for _, n in recent) / min(span, window_s)

    # ---------------------------------------------------------------- engine thread

    def _engine_thread_main(self, ready: asyncio.Future) -> None:
        try:
            self.engine = self._engine_factory()
            self.engine_healthy = True
            self._push_policy()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller of start()
            log.exception("engine failed to start")
            self._loop.call_soon_threadsafe(_set_exception, ready, RuntimeError(f"the engine failed to start: {exc}"))
            return
        self._loop.call_soon_threadsafe(_set_result, ready, None)
        try:
            self._engine_busy_loop()
        except BaseException:  # noqa: BLE001
            log.exception("engine loop died")
            self.engine_healthy = False
            self._fail_all("the engine loop died; see the server log")

    def _engine_busy_loop(self) -> None:
        by_rid: dict[Any, RequestStream] = {}
        self._by_rid = by_rid
        prev_stats: dict[str, float] = {}
        last_stats_at = 0.0
        while True:
            try:
                busy = self.engine is not None and self.engine.has_work()
            except Exception as exc:  # noqa: BLE001
                busy = False
                self._engine_failed(f"engine.has_work() failed: {exc}")
            try:
                item = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                item = None
            handled = 0
            while item is not None and handled < 10_000:
                if item[0] == "stop":
                    self._fail_all("the server is shutting down")
                    return
                self._handle(item, by_rid)
                handled += 1
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self.engine is not None and self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001
                    log.exception("engine.step() failed")
                    self._engine_failed(f"engine step failed: {type(exc).__name__}: {exc}")
                    continue
                self.engine_healthy = True
                self._fan_out(outputs, by_rid)
            now = time.monotonic()
            if now - last_stats_at >= STATS_INTERVAL_S or not by_rid:
                last_stats_at = now
                prev_stats = self._read_stats(prev_stats)

    def _handle(self, item: tuple, by_rid: dict) -> None:
        kind, payload = item
        if kind == "add":
            stream: RequestStream = payload
            if stream.done:     # gone before admission
                return
            s = stream.sampling
            try:
                params = self._params_factory(
                    max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    seed=s.seed, ignore_eos=s.ignore_eos, stop_token_ids=list(s.stop_token_ids))
                rid = self.engine.add_request(list(stream.prompt_ids), params)
            except EngineError as exc:     # e.g. EngineUnavailable: no engine process is READY
                self._post([(stream, None, False, None, exc)])
                return
            except Exception as exc:  # noqa: BLE001 - the engine refused this one request
                self._post([(stream, None, False, None, f"the engine refused the request: {exc}")])
                return
            stream._rid = rid
            by_rid[rid] = stream
            self._admitted += 1
        elif kind == "abort":
            stream = payload
            rid = getattr(stream, "_rid", None)
            if rid is not None and by_rid.pop(rid, None) is not None:
                self._admitted -= 1
                try:
                    self.engine.abort(rid)
                except Exception as exc:  # noqa: BLE001
                    log.warning("engine.abort(%r) failed: %s", rid, exc)
        elif kind == "call":
            fn, fut = payload
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001
                self._loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)

    def _fan_out(self, outputs: Sequence[tuple], by_rid: dict) -> None:
        batch = []
        for out in outputs:
            rid, token_id, finished, reason = out[0], out[1], bool(out[2]), out[3] if len(out) > 3 else None
            error = out[4] if len(out) > 4 else None
            stream = by_rid.get(rid)
            if stream is None:
                continue     # aborted meanwhile
            if finished or error is not None:
                del by_rid[rid]
                self._admitted -= 1
            if error is not None:
                self.requests_failed_total += 1
            batch.append((stream, None if token_id is None else int(token_id), finished, reason, error))
        n = sum(1 for b in batch if b[1] is not None)
        self.generated_tokens_total += n
        now = time.monotonic()
        self._recent_tokens.append((now, n))
        while self._recent_tokens and now - self._recent_tokens[0][0] > 10.0:
            self._recent_tokens.popleft()
        if batch:
            self._post(batch)

    def _post(self, batch: list[tuple]) -> None:
        try:
            self._loop.call_soon_threadsafe(_deliver_batch, batch)
        except RuntimeError:  # loop closed: the server is gone
            pass

    def _engine_failed(self, message: str) -> None:
        self.last_error = message
        self.engine_healthy = False
        self._fail_all(message)

    def _fail_all(self, message: str) -> None:
        by_rid = getattr(self, "_by_rid", {})
        failed = list(by_rid.items())
        by_rid.clear()
        self._admitted = 0
        for rid, _ in failed:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; nothing more to free
                pass
        self.requests_failed_total += len(failed)
        if failed:
            self._post([(s, None, False, None, message) for _, s in failed])

    def _read_stats(self, prev: dict[str, float]) -> dict[str, float]:
        try:
            cur = flatten_stats(getattr(self.engine, "stats", {}))
            healthy = getattr(self.engine, "healthy", None)      # an engine in another process says it
        except Exception as exc:  # noqa: BLE001
            log.warning("reading engine.stats failed: %s", exc)
            return prev
        if healthy is not None:
            self.engine_healthy = bool(healthy)
            if not healthy:
                self.last_error = str(getattr(self.engine, "last_error", "") or self.last_error)
        self.engine_stats = cur
        if self.policy is not None and prev:
            telemetry = telemetry_from_stats(prev, cur)
            if telemetry is not None and self.policy.observe(telemetry) is not None:
                self._push_policy()
        return cur

    def _push_policy(self) -> None:
        if self.policy is None or self.engine is None or not hasattr(self.engine, "set_policy"):
            return
        snap = self.policy.snapshot()
        try:
            self.engine.set_policy(cpu_shares=self.policy.worker_shares(), **{k: snap[k] for k in (
                "strategy", "fetch_fraction", "fetch_round", "fetch_select", "moe_prefetch", "moe_prefetch_budget")})
        except Exception as exc:  # noqa: BLE001
            log.warning("engine.set_policy failed: %s", exc)

    def push_policy_soon(self) -> None:
        """After a SetPolicy: hand the new policy to the engine on its thread."""
        self._send(("call", (lambda _e: self._push_policy(), _NullFuture())))

    def worker_info(self) -> list[dict[str, Any]]:
        return [{"name": "engine", "kind": getattr(self.engine, "kind", "in-process"),
                 "pid": int(getattr(self.engine, "pid", 0) or 0),
                 "state": "ready" if self.engine_healthy else ("stopped" if self.stopped else "failed"),
                 "restarts": self.restarts, "uptime_s": time.monotonic() - self.started_at,
                 "last_heartbeat_age_s": -1.0, "last_error": self.last_error}]


class _NullFuture:
    def done(self) -> bool:
        return True


def _set_result(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut, exc) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _deliver_batch(batch: list[tuple]) -> None:
    for stream, token_id, finished, reason, error in batch:
        stream._deliver(token_id, finished, reason, error)

