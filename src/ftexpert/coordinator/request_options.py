"""The OpenAI request options that reach the sampler beyond temperature and its filters: ``logprobs`` /
``top_logprobs`` and ``response_format`` (structured output: a `GrammarSpec`, proto/grammar_spec.py).

A bad value is a 400 naming the field; a JSON schema the grammar engine cannot compile is a 400 naming
``response_format.json_schema.schema`` with the engine's message, checked here, before the request is queued.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from ftexpert.proto.grammar_spec import GrammarError, GrammarSpec, check_grammar
from ftexpert.proto.sampling_params import MAX_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5         # /v1/completions' `logprobs` bound (OpenAI's)
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_logprobs(body: dict, chat: bool, bad: Callable[..., Exception]) -> int | None:
    """SamplingParams.logprobs: None (not asked), or how many alternatives to list with each token."""
    if not chat:                        # /v1/completions: logprobs is the number of alternatives
        n = body.get("logprobs")
        if n is None:
            return None
        if not _is_int(n) or not 0 <= n <= MAX_COMPLETION_LOGPROBS:
            raise bad(f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}, got {n!r}", "logprobs")
        return n
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise bad(f"'logprobs' must be true or false, got {asked!r}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}, got {top!r}", "top_logprobs")
        if not asked:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if asked else None


def parse_response_format(body: dict, bad: Callable[..., Exception]) -> GrammarSpec | None:
    """The grammar `response_format` asks for (None: plain text), compiled once here to refuse a bad schema."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad(f"'response_format' must be an object such as {{\"type\": \"json_object\"}}, got {fmt!r:.100}",
                  "response_format")
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r:.100}",
                  "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("'response_format.json_schema' must be an object with 'name' and 'schema'",
                  "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise bad(f"'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r:.100}",
                  "response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"'response_format.json_schema.strict' must be true or false, got {strict!r:.100}",
                  "response_format.json_schema.strict")
    schema = spec.get("schema")
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise bad(f"'{param}' must be a JSON schema object, got {schema!r:.100}", param)
    grammar = GrammarSpec.json_schema(schema, strict=bool(strict))
    try:
        check_grammar(grammar)
    except ImportError:
        raise bad("'response_format' (other than text) needs the grammar engine, which this server lacks "
                  "(pip install llguidance)", "response_format", "unsupported_parameter") from None
    except GrammarError as exc:
        raise bad(f"'{param}' cannot be enforced: {str(exc)[:1000]}", param, "invalid_json_schema") from None
    return grammar
