"""What the HTTP API's routes share (http_api.py's OpenAI routes, anthropic_api.py's Anthropic ones): JSON
responses and the error of an engine that is not there to generate."""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ftexpert.coordinator.engine_client import EngineFailed, EngineUnavailable
from ftexpert.coordinator.openai_requests import ApiError
from ftexpert.coordinator.tokenize_pool import RETRY_AFTER_S


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(data, ensure_ascii=False).encode("utf-8"),
                        content_type="application/json")


def unavailable_error(exc: EngineUnavailable) -> ApiError:
    """The engine process is gone, restarting, draining: 503, and the client may retry (Retry-After); or the
    supervisor gave up on it (EngineFailed): 503 `engine_failed`, and retrying here will not help."""
    if isinstance(exc, EngineFailed):
        return ApiError(503, f"generation failed: {exc}", type="service_unavailable", code="engine_failed")
    return ApiError(503, f"generation failed: {exc}", type="service_unavailable", code="engine_unavailable",
                    retry_after_s=RETRY_AFTER_S)
