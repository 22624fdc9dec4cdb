"""OpenAI-compatible HTTP API on aiohttp: /v1/models, /v1/completions, /v1/chat/completions,
/health, /metrics; and Anthropic's Messages API, /v1/messages and /v1/messages/count_tokens (anthropic_api.py),
whose errors are in Anthropic's shape ({"type": "error", "error": {"type", "message"}}).

Streaming answers are server-sent events (`data: {json}\\n\\n` ..., `data: [DONE]\\n\\n`). A client that
goes away mid-request cancels its handler (aiohttp's handler_cancellation), whose `finally` aborts
its engine requests, so their slots are freed at once. Every error is a JSON body in OpenAI's shape
({"error": {"message", "type", "param", "code"}}) with a 4xx/5xx status, and touches no other request;
a 503 the client may retry carries Retry-After.

The event loop only reads the body: JSON decoding, validation, the chat template and tokenizing run in the
TokenizePool (coordinator/tokenize_pool.py), bounded, so a flood of long prompts leaves /health and the
streams in flight responsive.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from ftexpert.coordinator.anthropic_api import AnthropicApi
from ftexpert.coordinator.anthropic_requests import anthropic_error_body, is_anthropic_path
from ftexpert.coordinator.auth import http_key_ok
from ftexpert.coordinator.engine_client import EngineError, EngineUnavailable
from ftexpert.coordinator.chat_output import ChatDeltas, chat_message, finish_reason
from ftexpert.coordinator.engine_service import Chunk, EngineService, RequestStream, RequestTimeout, ServiceUnavailable
from ftexpert.coordinator.http_common import json_response as _json_response, unavailable_error as _unavailable
from ftexpert.coordinator.logprobs import LogprobEntry, TokenPieces, chat_logprobs, completion_logprobs
from ftexpert.coordinator.metrics import PROMETHEUS_CONTENT_TYPE, HttpCounters, render_prometheus
from ftexpert.coordinator.openai_requests import ApiError, GenerationPlan, ModelInfo, parse_chat, parse_completion
from ftexpert.coordinator.tokenize_pool import RETRY_AFTER_S, TokenizePool, TokenizerBusy

log = logging.getLogger("ft.coordinator.http")

MAX_BODY_BYTES = 8 << 20
KEEPALIVE_TIMEOUT_S = 75.0
OPEN_PATHS = frozenset({"/health"})      # no token needed (liveness probes)


def error_response(err: ApiError, anthropic: bool = False) -> web.Response:
    resp = _json_response(anthropic_error_body(err) if anthropic else err.body(), err.status)
    if err.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    if err.retry_after_s is not None:
        resp.headers["Retry-After"] = str(err.retry_after_s)
    return resp


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _decode_json(raw: bytes | bytearray) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}"[:500]) from None


def _parse_body(parse: Any, raw: bytearray, model: ModelInfo) -> GenerationPlan:
    """On a tokenizer thread: JSON -> validated, tokenized request."""
    return parse(_decode_json(raw), model)


class HttpApi:
    def __init__(self, service: EngineService, model: ModelInfo, *, api_key: str | None = None,
                 tokenize: TokenizePool | None = None, workers: Any = None):
        self.service = service
        self.model = model
        self.api_key = api_key
        self.tokenize = tokenize or TokenizePool()
        self.workers = workers                # () -> the worker processes' info (for /metrics), or None
        self.counters = HttpCounters()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self._pieces: TokenPieces | None = None

    def _logprobs(self, entries: list[LogprobEntry] | None, chat: bool) -> dict[str, Any] | None:
        """A choice's (or a chunk's) `logprobs` in OpenAI's shape; None where the request did not ask."""
        if entries is None:
            return None
        if self._pieces is None:
            self._pieces = TokenPieces(self.model.codec.tokenizer)
        return chat_logprobs(entries, self._pieces) if chat else completion_logprobs(entries, self._pieces)

    # ------------------------------------------------------------------ app

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        anthropic = AnthropicApi(self)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id:.+}", self.get_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/messages", anthropic.messages)
        app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl_context=None) -> int:
        """Listen on host:port (0 = a free port; HTTPS with an ssl.SSLContext); returns the port."""
        try:
            self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None,
                                         keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        except TypeError:  # aiohttp < 3.9 has no such option and cancels handlers on disconnect anyway
            self._runner = web.AppRunner(self.build_app(), access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            await self._runner.cleanup()
            raise RuntimeError(f"cannot listen for HTTP on {host}:{port}: {exc}; pick another --port") from None
        sock.listen(1024)
        sock.setblocking(False)
        await web.SockSite(self._runner, sock, shutdown_timeout=5.0, ssl_context=ssl_context).start()
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        status = 500
        anthropic = is_anthropic_path(request.path)
        try:
            if request.path not in OPEN_PATHS and not http_key_ok(request.headers.get("Authorization"),
                                                                  request.headers.get("x-api-key"), self.api_key):
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: "
                                    "<key>' with the key the server was started with (FT_API_KEY / --api-key-file)",
                               code="invalid_api_key")
            resp = await handler(request)
            status = resp.status
            return resp
        except ApiError as err:
            status = err.status
            return error_response(err, anthropic)
        except web.HTTPException as exc:
            status = exc.status
            if exc.status == 405:
                message = f"{request.method} is not allowed on {request.path}"
            elif exc.status == 404:
                message = (f"no route {request.path}; see /v1/models, /v1/completions, /v1/chat/completions, "
                           f"/v1/messages")
            else:
                message = exc.reason
            return error_response(ApiError(exc.status, message), anthropic)
        except asyncio.CancelledError:
            status = 499     # client closed the request
            raise
        except Exception:  # noqa: BLE001 - one bad request never takes the server down
            log.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(ApiError(500, "internal server error; see the server log",
                                           type="server_error"), anthropic)
        finally:
            self.counters.count(route, status)

    async def _read_body(self, request: web.Request) -> bytearray:
        """The body as it arrives, chunk by chunk (aiohttp's read() joins all buffered chunks on every wake-up:
        for an 8 MB body that held the event loop for ~100 ms on the CI machine)."""
        too_large = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes; send a shorter prompt")
        if (request.content_length or 0) > MAX_BODY_BYTES:
            raise too_large
        body = bytearray()
        content = request.content
        while not content.at_eof():
            chunk, _ = await content.readchunk()
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_large
        return body

    async def _parse(self, request: web.Request, parse: Any) -> GenerationPlan:
        raw = await self._read_body(request)
        try:
            return await self.tokenize.run(_parse_body, parse, raw, self.model)
        except TokenizerBusy as exc:
            raise ApiError(503, str(exc), type="service_unavailable", code="tokenizer_busy",
                           retry_after_s=RETRY_AFTER_S) from None

    # ------------------------------------------------------------------ plain routes

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model.name, "object": "model", "created": self.model.created,
                "owned_by": self.model.owned_by, "max_model_len": self.model.context_length}

    async def list_models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model_id"] != self.model.name:
            raise ApiError(404, f"The model '{request.match_info['model_id'][:200]}' does not exist",
                           param="model", code="model_not_found")
        return _json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        s = self.service
        if s.stopped or s.draining:
            return _json_response({"status": "draining"}, 503)
        if s.engine_gave_up is not None:
            return _json_response({"status": "engine_failed", "error": s.engine_gave_up}, 503)
        if not s.engine_healthy:
            return _json_response({"status": "engine_unavailable", "error": s.last_error}, 503)
        return _json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        workers = self.workers() if self.workers is not None else []
        text = render_prometheus(self.service, self.counters, workers=workers, tokenize=self.tokenize)
        return web.Response(body=text.encode("utf-8"), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self._parse(request, parse_completion), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self._parse(request, parse_chat), chat=True)

    def _submit_all(self, plan: GenerationPlan) -> list[RequestStream]:
        streams: list[RequestStream] = []
        decode = self.model.codec.decode_special if plan.harmony else None
        try:
            k = 0
            for prompt in plan.prompts:
                for _ in range(plan.n):
                    streams.append(self.service.submit(prompt, plan.sampling[k], plan.stop, decode))
                    k += 1
        except ServiceUnavailable as exc:
            for s in streams:
                s.close()
            raise ApiError(503, str(exc), type="service_unavailable", code="service_unavailable",
                           retry_after_s=RETRY_AFTER_S) from None
        return streams

    def _observe(self, streams: list[RequestStream]) -> None:
        now = time.monotonic()
        for s in streams:
            if s.first_token_at is not None:
                self.counters.ttft.observe(s.first_token_at - s.created_at)
            self.counters.duration.observe(now - s.created_at)

    async def _generate(self, request: web.Request, plan: GenerationPlan, chat: bool) -> web.StreamResponse:
        streams = self._submit_all(plan)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:
            if plan.stream:
                return await self._stream_response(request, plan, streams, rid, created, chat)
            texts = [""] * len(streams)
            reasons: list[str | None] = [None] * len(streams)
            entries: list[list[LogprobEntry] | None] = [None] * len(streams)
            # parallel_tool_calls false: the reply is parsed as it comes, to end it at its first call
            single = chat and not plan.tool_choice.parallel
            watch = [ChatDeltas(plan.tools, plan.tool_choice, plan.harmony) for _ in streams] if single else []
            async for index, chunk in _merged(streams):
                texts[index] += chunk.text
                if watch and not watch[index].complete:
                    watch[index].feed(chunk.text)
                    if watch[index].complete:
                        streams[index].end()         # parallel_tool_calls false: its one call is made
                if chunk.logprobs is not None:
                    entries[index] = (entries[index] or []) + chunk.logprobs
                if chunk.finished:
                    reasons[index] = chunk.finish_reason
            self._observe(streams)
            usage = _usage(streams, plan.n)
            logprobs = [self._logprobs([] if e is None and s.sampling.logprobs is not None else e, chat)
                        for e, s in zip(entries, streams)]
            if chat:
                choices = []
                for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs)):
                    message, called = chat_message(t, plan.tools, plan.tool_choice, plan.harmony)
                    choices.append({"index": i, "message": message, "logprobs": lp,
                                    "finish_reason": finish_reason(r, called)})
                return _json_response({"id": rid, "object": "chat.completion", "created": created,
                                       "model": self.model.name, "choices": choices, "usage": usage})
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                       for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
            return _json_response({"id": rid, "object": "text_completion", "created": created,
                                   "model": self.model.name, "choices": choices, "usage": usage})
        except EngineUnavailable as exc:
            raise _unavailable(exc) from None
        except EngineError as exc:
            raise ApiError(500, f"generation failed: {exc}", type="server_error", code="engine_error") from None
        except RequestTimeout as exc:
            raise ApiError(504, str(exc), type="server_error", code="timeout") from None
        finally:
            for s in streams:
                s.close()

    async def _stream_response(self, request: web.Request, plan: GenerationPlan, streams: list[RequestStream],
                               rid: str, created: int, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_field = {"usage": None} if plan.include_usage else {}

        def frame(choices: list[dict]) -> bytes:
            return _sse({"id": rid, "object": obj, "created": created, "model": self.model.name,
                         "choices": choices, **usage_field})

        deltas = [ChatDeltas(plan.tools, plan.tool_choice, plan.harmony) for _ in streams]
        try:
            if chat:
                for i in range(len(streams)):
                    await resp.write(frame([{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]))
            async for index, chunk in _merged(streams):
                logprobs = self._logprobs(chunk.logprobs, chat) if chunk.logprobs else None
                if chat:
                    out = deltas[index].feed(chunk.text) + (deltas[index].finish() if chunk.finished else [])
                    if deltas[index].complete and not chunk.finished:
                        streams[index].end()         # parallel_tool_calls false: its one call is made
                    if logprobs and not out:
                        out = [{"content": ""}]          # the logprobs of text held back (a possible call's start)
                    for k, delta in enumerate(out):
                        await resp.write(frame([{"index": index, "delta": delta,
                                                 "logprobs": logprobs if k == 0 else None, "finish_reason": None}]))
                    if chunk.finished:
                        await resp.write(frame([{"index": index, "delta": {}, "logprobs": None,
                                                 "finish_reason": finish_reason(chunk.finish_reason,
                                                                                deltas[index].made_calls)}]))
                elif chunk.text or chunk.finished or logprobs:
                    await resp.write(frame([{"index": index, "text": chunk.text, "logprobs": logprobs,
                                             "finish_reason": chunk.finish_reason if chunk.finished else None}]))
            self._observe(streams)
            if plan.include_usage:
                await resp.write(_sse({"id": rid, "object": obj, "created": created, "model": self.model.name,
                                       "choices": [], "usage": _usage(streams, plan.n)}))
        except (EngineError, RequestTimeout) as exc:
            err = _unavailable(exc) if isinstance(exc, EngineUnavailable) else \
                ApiError(500, f"generation failed: {exc}", type="server_error", code="engine_error")
            await resp.write(_sse(err.body()))
        except (ConnectionResetError, ConnectionError):
            return resp                       # client gone: the caller's finally aborts the streams
        try:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass                              # client gone after the last chunk: nothing left to tell it
        return resp


def _usage(streams: list[RequestStream], n: int) -> dict[str, int]:
    """Token counts; the n choices of one prompt share it, so it is counted once (as OpenAI does)."""
    prompt = sum(s.prompt_tokens for s in streams[::n])
    completion = sum(s.completion_tokens for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Chunk]]:
    """Chunks of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for chunk in streams[0].chunks():
            yield 0, chunk
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for chunk in s.chunks():
                q.put_nowait((i, chunk, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, None, exc))
        finally:
            q.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, chunk, exc = await q.get()
            if exc is not None:
                raise exc
            if chunk is None:
                open_streams -= 1
                continue
            yield i, chunk
    finally:
        for t in tasks:
            t.cancel()
