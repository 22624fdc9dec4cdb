"""The engine behind the front doors: EngineService fans an EngineClient's tokens out to RequestStreams.

Everything here runs on the event loop. The HTTP API calls `submit()` and iterates the returned
RequestStream (gRPC does the same through `run_coroutine_threadsafe`); the engine client
(coordinator/engine_client.py: RemoteEngine or InlineEngine) delivers token batches, request failures and
stats snapshots as EngineEvents. A stream turns token ids into text (incremental detokenizer, stop
strings). Aborts (client gone, stop string met, drain timeout) go straight to the client. Each stats
snapshot is also the policy tuner's telemetry; its decisions go back to the engine as SET_POLICY.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from ftexpert.coordinator.detokenizer import IncrementalDetokenizer, StopStringMatcher
from ftexpert.coordinator.engine_client import EngineClient, EngineError, EngineUnavailable
from ftexpert.coordinator.logprobs import LogprobEntry, LogprobTrail
from ftexpert.coordinator.policy import FetchPolicy, StepTelemetry
from ftexpert.proto import engine_messages as em
from ftexpert.proto.sampling_params import SamplingParams, TokenLogprobs

DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_PENDING_REQUESTS = 512

FINISH_REASONS = {"stop": "stop", "eos": "stop", "stop_token": "stop", "length": "length",
                  "max_tokens": "length", "abort": "abort", "aborted": "abort"}


class ServiceUnavailable(Exception):
    """Not accepting requests (draining, stopped, too many pending). HTTP 503 / gRPC UNAVAILABLE."""


class RequestTimeout(Exception):
    """The request outlived its deadline and was aborted."""


@dataclasses.dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None   # the request asked: the tokens whose text this chunk completes


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

    def __init__(self, service: "EngineService", prompt_ids: Sequence[int], sampling: SamplingParams,
                 stop: Sequence[str], deadline_s: float, decode: Callable[[Sequence[int]], str] | None = None):
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
        self._detok = IncrementalDetokenizer(decode or service.decode, self.prompt_ids)
        self._stops = StopStringMatcher(stop)
        self._trail = LogprobTrail() if sampling.logprobs is not None else None
        self._rid: int | None = None            # the engine's id, while the engine has this request

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended this request (finish_reason 'stop'), or None."""
        return self._stops.matched

    def _deliver(self, token_id: int | None, finished: bool, reason: str | None,
                 error: str | EngineError | None = None, logprobs: TokenLogprobs | None = None) -> None:
        """An event from the engine (or a local terminal event); ignored once terminal."""
        if self.done:
            return
        if finished or error is not None:
            self.done = True
        self._events.put_nowait((token_id, finished, reason, error, logprobs))

    def _release_engine(self) -> None:
        """Abort this request in the engine (frees its slots); no event for the consumer."""
        self.service._release(self)

    def abort(self, error: str | EngineError | None = None) -> None:
        """Free the engine's slots for this request and end its stream (idempotent).

        With `error`, a consumer still reading gets it raised (a str as EngineError); else finish_reason
        'abort'."""
        if self.done:
            return
        self._release_engine()
        self.service.requests_aborted_total += 1
        self._deliver(None, True, "abort", error)

    def end(self) -> None:
        """The consumer has what the request asked for before the engine finished (the one tool call a request
        allows): free the engine's slots and end the stream as stopped (finish_reason 'stop'), not aborted. Events
        already queued are still read; the last chunk is the stop."""
        if self.done:
            return
        self._release_engine()
        self._deliver(None, True, "stop")

    def _released(self, text: str, final: bool = False, stopped: bool = False) -> list[LogprobEntry] | None:
        """The logprobs of the tokens whose text `text` completes (None: the request did not ask for them)."""
        if self._trail is None:
            return None
        return self._trail.finish(text, stopped) if final else self._trail.emit(text)

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
                    token_id, finished, reason, error, logprobs = await asyncio.wait_for(self._events.get(),
                                                                                         remaining)
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
                        piece = self._detok.add(token_id)
                        if self._trail is not None:
                            self._trail.add(token_id, logprobs, piece)
                        text = self._stops.feed(piece)
                if self._stops.stopped:
                    if not self.done:
                        self._release_engine()   # the engine would go on: free its slots now
                        self.done = True
                    self.finish_reason = "stop"
                    self.service._finished(self, "stop")
                    yield Chunk(text, ids, True, "stop", self._released(text, True, True))
                    return
                if finished:
                    piece = self._detok.flush()
                    if self._trail is not None:
                        self._trail.text(piece)
                    text += self._stops.feed(piece)
                    if self._stops.stopped:
                        reason = "stop"
                    else:
                        text += self._stops.flush()
                    self.finish_reason = FINISH_REASONS.get(str(reason), str(reason or "stop"))
                    self.service._finished(self, self.finish_reason)
                    yield Chunk(text, ids, True, self.finish_reason, self._released(text, True, self._stops.stopped))
                    return
                if text or ids:
                    yield Chunk(text, ids, logprobs=self._released(text))
        finally:
            self.close()               # consumer left early (client gone, cancelled): free the slots


class EngineService:
    """Fans the engine client's tokens out to RequestStreams (an EngineEvents); keeps the service's figures."""

    def __init__(self, engine: EngineClient, decode: Callable[[Sequence[int]], str], *,
                 policy: FetchPolicy | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS):
        self.engine = engine
        self.decode = decode
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self.max_pending_requests = max_pending_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.monotonic()
        self.draining = False
        self.stopped = False
        self.live: set[RequestStream] = set()
        self._by_rid: dict[int, RequestStream] = {}       # requests the engine has
        self.requests_total = 0
        self.requests_failed_total = 0
        self.requests_aborted_total = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {}
        self.restarts = 0
        self.engine_stats: dict[str, float] = {}
        self._recent_tokens: collections.deque = collections.deque()  # (time, tokens) per step, last 10 s
        self._idle = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def start(self, timeout_s: float = 600.0) -> None:
        """Connect the engine (an inline one is built now: first use may compile)."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        await asyncio.wait_for(self.engine.start(self), timeout_s)
        self.push_policy()

    async def stop(self) -> None:
        self.stopped = self.draining = True
        self._fail_all("the server is shutting down; retry against another replica")
        for s in list(self.live):
            s._deliver(None, False, None, EngineUnavailable("the server is shutting down; retry against another "
                                                            "replica"))
        await self.engine.stop()

    @property
    def engine_healthy(self) -> bool:
        return self.engine.health().ready

    @property
    def last_error(self) -> str:
        return self.engine.health().last_error

    @property
    def engine_gave_up(self) -> str | None:
        """Why the supervisor stopped restarting the engine, or None (see EngineFailed)."""
        return getattr(self.engine, "gave_up", None)

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, stop: Sequence[str] = (),
               decode: Callable[[Sequence[int]], str] | None = None) -> RequestStream:
        """A request's stream; `decode`: its text's decoder where not the service's (special tokens kept)."""
        if self.stopped:
            raise ServiceUnavailable("the server is shutting down; retry against another replica")
        if self.draining:
            raise ServiceUnavailable("the server is draining and accepts no new requests; retry later "
                                     "or against another replica")
        if len(self.live) >= self.max_pending_requests:
            raise ServiceUnavailable(f"too many requests in flight ({len(self.live)}); retry shortly")
        stream = RequestStream(self, prompt_ids, sampling, stop, self.request_timeout_s, decode)
        self.live.add(stream)
        self._idle.clear()
        self.requests_total += 1
        self.prompt_tokens_total += stream.prompt_tokens
        try:
            stream._rid = self.engine.submit(stream.prompt_ids, sampling)
        except EngineError as exc:        # EngineUnavailable: no engine is ready
            stream._deliver(None, False, None, exc)
        else:
            self._by_rid[stream._rid] = stream
        return stream

    def _release(self, stream: RequestStream) -> None:
        rid, stream._rid = stream._rid, None
        if rid is not None and self._by_rid.pop(rid, None) is not None:
            self.engine.abort(rid)

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
            s.abort(EngineUnavailable(f"aborted: the server drained and stopped waiting after {timeout_s:g} s; "
                                      f"retry against another replica"))
        return before - len(left), len(left)

    def resume(self) -> None:
        if not self.stopped:
            self.draining = False

    async def restart_engine(self) -> None:
        """Fail the requests in flight and replace the engine (a fresh one from the factory inline, a new
        GPU worker process otherwise)."""
        self._fail_all("the engine was restarted by an operator; retry the request")
        await self.engine.restart()
        self.restarts += 1

    def _fail_all(self, message: str) -> None:
        failed, self._by_rid = self._by_rid, {}
        for rid, stream in failed.items():
            stream._rid = None
            self.engine.abort(rid)
            stream._deliver(None, False, None, EngineUnavailable(message))   # the client may retry
        self.requests_failed_total += len(failed)

    # ---------------------------------------------------------------- EngineEvents

    def on_tokens(self, outputs: list[tuple[int, int, bool, str | None, TokenLogprobs | None]]) -> None:
        for rid, token_id, finished, reason, logprobs in outputs:
            stream = self._by_rid.get(rid)
            if stream is None:
                continue
            if finished:
                del self._by_rid[rid]
                stream._rid = None
            stream._deliver(token_id, finished, reason, logprobs=logprobs)
        self.generated_tokens_total += len(outputs)
        now = time.monotonic()
        self._recent_tokens.append((now, len(outputs)))
        while self._recent_tokens and now - self._recent_tokens[0][0] > 10.0:
            self._recent_tokens.popleft()

    def on_request_failed(self, request_id: int, error: EngineError) -> None:
        stream = self._by_rid.pop(request_id, None)
        if stream is not None:
            stream._rid = None
            self.requests_failed_total += 1
            stream._deliver(None, False, None, error)

    def on_stats(self, stats: dict[str, float]) -> None:
        prev, self.engine_stats = self.engine_stats, stats
        if self.policy is not None and prev:
            telemetry = telemetry_from_stats(prev, stats)
            if telemetry is not None and self.policy.observe(telemetry) is not None:
                self.push_policy()

    # ---------------------------------------------------------------- policy

    def push_policy(self) -> None:
        """Hand the policy in force to the engine (now, and to every engine that becomes ready later)."""
        if self.policy is None:
            return
        snap = self.policy.snapshot()
        shares = self.policy.worker_shares()          # empty: the engine keeps its own split
        fields = {f.name: snap[f.name] for f in dataclasses.fields(em.SetPolicy)
                  if f.name not in ("cpu_share_names", "cpu_share_values")}
        self.engine.set_policy(em.SetPolicy(**fields, cpu_share_names=[str(n) for n in shares],
                                            cpu_share_values=[float(v) for v in shares.values()]))

    def push_policy_soon(self) -> None:
        """After a SetPolicy (from a gRPC thread): push it on the event loop."""
        self._loop.call_soon_threadsafe(self.push_policy)

    # ---------------------------------------------------------------- figures

    @property
    def requests_waiting(self) -> int:
        waiting = self.engine_stats.get("num_waiting")
        return int(waiting) if waiting is not None else max(0, len(self.live) - len(self._by_rid))

    @property
    def requests_running(self) -> int:
        running = self.engine_stats.get("num_running")
        return int(running) if running is not None else len(self._by_rid)

    def tokens_per_s(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent_tokens) if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else window_s
        return sum(n for _, n in recent) / min(span, window_s)

    def worker_info(self) -> list[dict[str, Any]]:
        h = self.engine.health()
        return [{"name": "engine", "kind": h.kind, "pid": h.pid,
                 "state": "ready" if h.ready else ("stopped" if self.stopped else "failed"),
                 "restarts": self.restarts, "uptime_s": time.monotonic() - self.started_at,
                 "last_heartbeat_age_s": -1.0, "last_error": h.last_error}]
