"""The Anthropic Messages API on the HTTP server: POST /v1/messages, plain and streamed, and
POST /v1/messages/count_tokens.

A request is parsed and tokenized off the event loop as the OpenAI routes' are (anthropic_requests.py), runs as one
engine request through HttpApi's submit path, and is answered in Anthropic's shapes: a `message` object, or the
server-sent events message_start, content_block_start, ping, content_block_delta (text_delta) ..., content_block_stop,
message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop; with tools, the model's calls are
tool_use blocks (anthropic_output.py: their input streamed as input_json_delta) and the text block opens at the
first text. An engine failure after the stream
began is an `event: error` that ends it; errors before that are JSON in Anthropic's error shape, which the HTTP
middleware writes for these routes (http_api.py). A client that leaves cancels the handler, which frees the
request's engine slots (RequestStream.close), as on the OpenAI routes.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Protocol

from aiohttp import web

from ftexpert.coordinator.anthropic_output import MessageBlocks
from ftexpert.coordinator.anthropic_requests import anthropic_error_body, parse_count_tokens, parse_messages_request
from ftexpert.coordinator.engine_client import EngineError, EngineUnavailable
from ftexpert.coordinator.engine_service import RequestStream, RequestTimeout
from ftexpert.coordinator.http_common import json_response, unavailable_error
from ftexpert.coordinator.openai_requests import ApiError, GenerationPlan, ModelInfo

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return (b"event: " + name.encode("ascii") + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode("utf-8")
            + b"\n\n")


def stop_reason(stream: RequestStream, made_calls: bool = False) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished stream (`tool_use`: it ended by itself after
    making calls)."""
    if stream.stop_string is not None:
        return "stop_sequence", stream.stop_string
    if stream.finish_reason == "length":
        return "max_tokens", None
    return ("tool_use" if made_calls else "end_turn"), None


def generation_error(exc: EngineError | RequestTimeout) -> ApiError:
    if isinstance(exc, EngineUnavailable):
        return unavailable_error(exc)
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), type="server_error", code="timeout")
    return ApiError(500, f"generation failed: {exc}", type="server_error", code="engine_error")


class RouteHost(Protocol):
    """What the handlers use of HttpApi (http_api.py), which registers them: the served model, the body parsed
    on the tokenizer pool, the submit path (503 when the service refuses) and the latency figures."""
    model: ModelInfo

    async def _parse(self, request: web.Request, parse: Any) -> Any: ...

    def _submit_all(self, plan: GenerationPlan) -> list[RequestStream]: ...

    def _observe(self, streams: list[RequestStream]) -> None: ...


class AnthropicApi:
    """The handlers of the Anthropic routes."""

    def __init__(self, api: RouteHost):
        self.api = api

    def _message(self, mid: str, content: list[dict], stream: RequestStream, *, done: bool,
                 made_calls: bool = False) -> dict[str, Any]:
        reason, sequence = stop_reason(stream, made_calls) if done else (None, None)
        return {"id": mid, "type": "message", "role": "assistant", "content": content, "model": self.api.model.name,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": stream.completion_tokens}}

    async def count_tokens(self, request: web.Request) -> web.Response:
        return json_response({"input_tokens": await self.api._parse(request, parse_count_tokens)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        plan = await self.api._parse(request, parse_messages_request)
        [stream] = self.api._submit_all(plan)
        mid = "msg_" + uuid.uuid4().hex
        blocks = MessageBlocks(plan.tools, plan.tool_choice, plan.harmony)
        try:
            if plan.stream:
                return await self._stream_response(request, stream, mid, blocks)
            async for chunk in stream.chunks():
                blocks.feed(chunk.text)
                if blocks.complete:
                    stream.end()                   # disable_parallel_tool_use: its one call is made
            blocks.finish()
            self.api._observe([stream])
            return json_response(self._message(mid, blocks.final_content(), stream, done=True,
                                               made_calls=blocks.made_calls))
        except (EngineError, RequestTimeout) as exc:
            raise generation_error(exc) from None
        finally:
            stream.close()

    async def _stream_response(self, request: web.Request, stream: RequestStream, mid: str,
                               blocks: MessageBlocks) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)

        async def send(events: list[tuple[str, dict]]) -> None:
            for name, data in events:
                await resp.write(_event(name, data))

        try:
            await resp.write(_event("message_start", {"type": "message_start",
                                                      "message": self._message(mid, [], stream, done=False)}))
            await send(blocks.start())
            await resp.write(_event("ping", {"type": "ping"}))
            async for chunk in stream.chunks():
                await send(blocks.feed(chunk.text))
                if blocks.complete:
                    stream.end()                   # disable_parallel_tool_use: its one call is made
            await send(blocks.finish())
            self.api._observe([stream])
            reason, sequence = stop_reason(stream, blocks.made_calls)
            await resp.write(_event("message_delta", {"type": "message_delta",
                                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                      "usage": {"output_tokens": stream.completion_tokens}}))
            await resp.write(_event("message_stop", {"type": "message_stop"}))
        except (EngineError, RequestTimeout) as exc:
            await resp.write(_event("error", anthropic_error_body(generation_error(exc))))
        except ConnectionError:
            return resp                       # client gone: the caller's finally aborts the stream
        try:
            await resp.write_eof()
        except ConnectionError:
            pass                              # client gone after the last event: nothing left to tell it
        return resp
