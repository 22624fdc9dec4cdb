"""gRPC control plane (ft.control.v1.Control) and the standard health service (grpc.health.v1).

A plain threaded `grpc.server` (not grpc.aio): it is independent of the event loop (asyncio or
uvloop) and of grpcio's asyncio support, which differs across the grpcio versions we meet. Handlers
reach the coordinator's asyncio side through `asyncio.run_coroutine_threadsafe`, always with a timeout.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Protocol

import grpc

from ftexpert.coordinator.auth import bearer_ok
from ftexpert.coordinator.engine_client import EngineError, EngineUnavailable
from ftexpert.coordinator.engine_service import RequestTimeout, ServiceUnavailable
from ftexpert.coordinator.metrics import service_stats
from ftexpert.coordinator.text_codec import ChatMessage
from ftexpert.coordinator.token_bounds import utf8_length_over
from ftexpert.coordinator.tokenize_pool import TokenizerBusy
from ftexpert.proto import control_rpc as rpc
from ftexpert.proto.sampling_params import SamplingParams, check_prompt



class ControlHost(Protocol):
    """What the control servicer needs of the server that runs it (coordinator/server.py's CoordinatorServer)."""
    loop: asyncio.AbstractEventLoop
    service: Any                        # engine_service.EngineService
    policy: Any                         # policy.FetchPolicy
    model: Any                          # openai_requests.ModelInfo
    drain_timeout_s: float

    def workers(self) -> list[dict[str, Any]]: ...

    def worker(self, name: str) -> dict[str, Any] | None: ...

    async def restart_worker(self, name: str) -> None: ...

    def request_shutdown(self, drain_timeout_s: float | None = None) -> None: ...

    def component_health(self) -> dict[str, bool]: ...

log = logging.getLogger("ft.coordinator.grpc")

MAX_WORKERS = 32
MAX_CONCURRENT_RPCS = 64                  # beyond this: RESOURCE_EXHAUSTED, not an unbounded queue
CALL_TIMEOUT_S = 30.0                     # a control call waiting on the event loop
HEALTH_WATCH_POLL_S = 0.5
HEALTH_WATCH_MAX_S = 3600.0               # a Watch stream ends (client re-subscribes) after this
GENERATE_DEFAULT_MAX_TOKENS = 16
OPEN_METHOD_PREFIX = f"/{rpc.HEALTH_SERVICE}/"   # health checks need no token


API_KEY_REFUSAL = ("missing or wrong API key: send metadata 'authorization: Bearer <key>' with the key the server "
                   "was started with (FT_API_KEY or ft ctl --api-key-file)")


class _AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, api_key: str | None):
        self.api_key = api_key
        self.refusal = API_KEY_REFUSAL        # what a caller without the key is told (the control key's own text)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self.refusal)
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if self.api_key is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIX):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_ok(metadata.get("authorization"), self.api_key):
            return continuation(handler_call_details)
        return self._deny


def _policy_message(p: dict[str, Any]) -> Any:
    fields = {k: p[k] for k in ("strategy", "fetch_fraction", "fetch_fraction_q16", "fetch_fraction_min",
                                "fetch_fraction_max", "auto_tune", "fetch_round", "prefetch", "prefetch_budget",
                                "target_fraction", "pcie_gb_s", "cpu_gb_s", "source",
                                "reason", "decisions_total", "telemetry_steps_total")}
    msg = rpc.msg.Policy(**fields)
    for w in p["workers"]:
        msg.workers.add(name=w["name"], share=w["share"], cpu_gb_s=w["cpu_gb_s"])
    return msg


def _worker_message(w: dict[str, Any]) -> Any:
    return rpc.msg.Worker(name=w["name"], kind=w["kind"], state=w["state"], pid=int(w.get("pid") or 0),
                          restarts=int(w.get("restarts", 0)), uptime_s=float(w.get("uptime_s", 0.0)),
                          last_heartbeat_age_s=float(w.get("last_heartbeat_age_s", -1.0)),
                          last_error=str(w.get("last_error", "")))


class ControlServicer:
    def __init__(self, server: "ControlHost"):
        self.server = server

    def _run(self, coro, context, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.server.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the coordinator did not answer within {timeout_s:g} s")

    def GetStats(self, request, context):
        s = service_stats(self.server.service)
        msg = rpc.msg.Stats(**{k: s[k] for k in (
            "uptime_s", "draining", "requests_running", "requests_waiting", "requests_total",
            "requests_failed_total", "requests_aborted_total", "prompt_tokens_total", "generated_tokens_total",
            "generated_tokens_per_s", "expert_hit_rate", "expert_misses_per_token", "pcie_gb_s",
            "cpu_expert_time_s_total", "engine_error", "prefetch_precision", "prefetch_useful_per_layer",
            "prefetch_covered_share")},
            experts_fetched_total=int(s["experts_fetched_total"]), experts_cpu_total=int(s["experts_cpu_total"]))
        if s["policy"] is not None:
            msg.policy.CopyFrom(_policy_message(s["policy"]))
        for k, v in s["engine"].items():
            msg.engine[k] = v
        return msg

    def GetPolicy(self, request, context):
        return _policy_message(self.server.policy.snapshot())

    def SetPolicy(self, request, context):
        changes = {f.name: value for f, value in request.ListFields()}
        try:
            snap = self.server.policy.update(**changes)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.server.service.push_policy_soon()
        log.info("policy changed by an operator: %s", changes)
        return _policy_message(snap)

    def ListWorkers(self, request, context):
        return rpc.msg.ListWorkersResponse(workers=[_worker_message(w) for w in self.server.workers()])

    def RestartWorker(self, request, context):
        if self.server.worker(request.name) is None:
            names = sorted({"engine", *(w["name"] for w in self.server.workers())})
            context.abort(grpc.StatusCode.NOT_FOUND, f"no worker named {request.name!r}; workers: {', '.join(names)}")
        try:
            self._run(self.server.restart_worker(request.name), context, timeout_s=600.0)
        except (RuntimeError, ValueError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return rpc.msg.RestartWorkerResponse(worker=_worker_message(self.server.worker(request.name)))

    def Drain(self, request, context):
        if request.resume:
            self.server.service.resume()
            return rpc.msg.DrainResponse(draining=self.server.service.draining)
        timeout_s = request.timeout_s if request.timeout_s > 0 else self.server.drain_timeout_s
        finished, aborted = self._run(self.server.service.drain(timeout_s), context, timeout_s + CALL_TIMEOUT_S)
        return rpc.msg.DrainResponse(requests_finished=finished, requests_aborted=aborted, draining=True)

    def Shutdown(self, request, context):
        timeout_s = request.drain_timeout_s if request.drain_timeout_s > 0 else self.server.drain_timeout_s
        self.server.loop.call_soon_threadsafe(self.server.request_shutdown, timeout_s)
        return rpc.msg.ShutdownResponse(accepted=True)

    def Generate(self, request, context):
        server = self.server
        codec = server.model.codec
        sampling_msg = request.sampling
        try:
            # on a tokenizer thread, as HTTP requests are: the same bound on how many at once
            prompt_ids = server.tokenize.call(self._prompt_ids, request, codec, server.model, timeout_s=CALL_TIMEOUT_S)
            sampling = self._sampling(request, sampling_msg, prompt_ids)
        except TokenizerBusy as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except concurrent.futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"tokenizing the prompt took over {CALL_TIMEOUT_S:g} s")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stop = [s for s in request.stop if s]
        out: queue.Queue = queue.Queue()

        async def produce() -> None:
            try:
                stream = server.service.submit(prompt_ids, sampling, stop)
            except ServiceUnavailable as exc:
                out.put(("error", grpc.StatusCode.UNAVAILABLE, str(exc)))
                return
            try:
                async for chunk in stream.chunks():
                    out.put(("chunk", chunk, stream))
            except EngineUnavailable as exc:
                out.put(("error", grpc.StatusCode.UNAVAILABLE, f"generation failed: {exc}"))
            except EngineError as exc:
                out.put(("error", grpc.StatusCode.INTERNAL, f"generation failed: {exc}"))
            except RequestTimeout as exc:
                out.put(("error", grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)))
            finally:
                stream.close()
                out.put(("end", None, None))

        fut = asyncio.run_coroutine_threadsafe(produce(), server.loop)
        context.add_callback(fut.cancel)       # client gone / RPC over: cancel -> stream.close() -> abort
        deadline = time.monotonic() + server.service.request_timeout_s + CALL_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not context.is_active():
                fut.cancel()
                return
            try:
                kind, a, b = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if kind == "end":
                return
            if kind == "error":
                context.abort(a, b)
            chunk, stream = a, b
            msg = rpc.msg.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids, finished=chunk.finished,
                                        finish_reason=chunk.finish_reason or "")
            if chunk.finished:
                msg.usage.prompt_tokens = stream.prompt_tokens
                msg.usage.completion_tokens = stream.completion_tokens
            yield msg

    @staticmethod
    def _prompt_ids(request, codec, model) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if not request.prompt:
            raise ValueError("give a prompt (text) or prompt_token_ids")
        limit = codec.max_prompt_bytes(model.context_length)
        if limit is not None and utf8_length_over(request.prompt, limit):
            raise ValueError(f"This model's maximum context length is {model.context_length} tokens, and the prompt "
                             f"has more than {limit} bytes, more than that many tokens can hold; shorten the prompt")
        if request.chat:
            return codec.encode_chat([ChatMessage("user", request.prompt)], limit=model.context_length)
        return codec.encode(request.prompt, limit=model.context_length)

    def _sampling(self, request, s, prompt_ids: list[int]) -> SamplingParams:
        model = self.server.model
        max_tokens = check_prompt(prompt_ids, request.max_tokens or GENERATE_DEFAULT_MAX_TOKENS, model.context_length,
                                  model.codec.vocab_size)
        top_k = s.top_k if s.HasField("top_k") else 0
        temperature = s.temperature if s.HasField("temperature") else 1.0
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                              top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=0 if top_k == -1 else top_k,
                              seed=s.seed if s.HasField("seed") else None, ignore_eos=s.ignore_eos,
                              stop_token_ids=() if s.ignore_eos else tuple(model.codec.eos_token_ids))


class HealthServicer:
    """grpc.health.v1: '' (the whole service), the Control service, and one entry per component."""

    def __init__(self, server: "ControlHost"):
        self.server = server
        self._stopping = threading.Event()

    def statuses(self) -> dict[str, int]:
        serving, not_serving = rpc.SERVING_STATUS.Value("SERVING"), rpc.SERVING_STATUS.Value("NOT_SERVING")
        state = self.server.component_health()
        return {name: serving if ok else not_serving for name, ok in state.items()}

    def Check(self, request, context):
        statuses = self.statuses()
        if request.service not in statuses:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}; known: "
                                                     f"{', '.join(sorted(statuses))}")
        return rpc.health.HealthCheckResponse(status=statuses[request.service])

    def List(self, request, context):
        response = rpc.health.HealthListResponse()
        for name, status in self.statuses().items():
            response.statuses[name].status = status
        return response

    def Watch(self, request, context):
        unknown = rpc.SERVING_STATUS.Value("SERVICE_UNKNOWN")
        last = None
        deadline = time.monotonic() + HEALTH_WATCH_MAX_S
        while context.is_active() and time.monotonic() < deadline:
            status = self.statuses().get(request.service, unknown)
            if status != last:
                last = status
                yield rpc.health.HealthCheckResponse(status=status)
            if self._stopping.wait(HEALTH_WATCH_POLL_S):
                return

    def stop(self) -> None:
        self._stopping.set()


class GrpcServer:
    def __init__(self, server: "ControlHost", api_key: str | None, tls: Any = None):
        self.tls = tls                        # coordinator.tls.TlsFiles: listen with TLS
        self.health = HealthServicer(server)
        self.auth = _AuthInterceptor(api_key)
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=MAX_WORKERS,
                                                                         thread_name_prefix="ft-grpc"),
                                   interceptors=[self.auth],
                                   maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                                   options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers([rpc.control_handlers(ControlServicer(server)),
                                               rpc.health_handlers(self.health)])
        self.port: int | None = None

    def start(self, host: str, port: int) -> int:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if self.tls is not None:
                bound = self._server.add_secure_port(address, self.tls.grpc_credentials())
            else:
                bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen for gRPC on {address}: {exc}; pick another --grpc-port") from None
        if bound == 0:
            raise RuntimeError(f"cannot listen for gRPC on {address} (in use?); pick another --grpc-port")
        self._server.start()
        self.port = bound
        return bound

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.stop()
        self._server.stop(grace_s).wait(grace_s + 1.0)

