"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) against a live server on 127.0.0.1: the
official `anthropic` client on the real tiny engine for the happy paths, raw HTTP for the exact event stream and the
errors (the fake engine, where the engine does not matter)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import anthropic
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import CONTEXT_LENGTH, FAKE_TEXT, MODEL_NAME, live_server  # noqa: E402
from test_http_api import fake, raw, tiny  # noqa: E402,F401 - the live servers (module-scoped fixtures), raw HTTP

from ftexpert.coordinator.text_codec import ChatMessage  # noqa: E402

GREEDY = {"temperature": 0}
SYSTEM = "You answer in the words of the book."
TURNS = [{"role": "user", "content": "Who made the heaven?"},
         {"role": "assistant", "content": [{"type": "text", "text": "God made "}, {"type": "text", "text": "it."}]},
         {"role": "user", "content": [{"type": "text", "text": "And the earth?"}]}]


def client(ls, api_key: str | None = "unused", **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ls.base_url, api_key=api_key, max_retries=0, timeout=30, **kwargs)


def sse_events(data: bytes) -> list[tuple[str, dict]]:
    """(event name, JSON data) of each server-sent event, in order."""
    events = []
    for frame in data.decode().split("\n\n"):
        if frame.strip():
            lines = dict(line.split(": ", 1) for line in frame.split("\n"))
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def prompt_tokens(ls, messages: list[tuple[str, str]]) -> int:
    return len(ls.server.model.codec.encode_chat([ChatMessage(role, content) for role, content in messages]))


# ---------------------------------------------------------------- the real tiny engine, anthropic client

def test_message_shape_and_the_stream_equals_the_message(tiny):
    c = client(tiny)
    messages = [{"role": "user", "content": "In the beginning"}]
    msg = c.messages.create(model=MODEL_NAME, max_tokens=12, messages=messages, metadata={"user_id": "u-1"},
                            extra_body=GREEDY)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL_NAME and len(msg.content) == 1 and msg.content[0].type == "text"
    assert msg.content[0].text and msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens == prompt_tokens(tiny, [("user", "In the beginning")])
    assert 0 < msg.usage.output_tokens <= 12
    if msg.usage.output_tokens < 12:
        assert msg.stop_reason == "end_turn"
    with c.messages.stream(model=MODEL_NAME, max_tokens=12, messages=messages, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == msg.content[0].text                  # greedy: the same tokens either way
    assert final.content[0].text == streamed and final.stop_reason == msg.stop_reason
    assert final.usage.input_tokens == msg.usage.input_tokens and final.usage.output_tokens == msg.usage.output_tokens


def test_the_stream_is_anthropics_event_sequence(tiny):
    body = {"model": MODEL_NAME, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}],
            **GREEDY}
    status, data, headers = raw(tiny, "POST", "/v1/messages", json.dumps(body), {"anthropic-version": "2023-06-01"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(data)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == (["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert all(payload["type"] == name for name, payload in events)
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["content"] == []
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] == prompt_tokens(tiny, [("user", "Hi")])
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(p["delta"]["text"] for n, p in events if n == "content_block_delta")
    assert all(p["delta"]["type"] == "text_delta" and p["index"] == 0 for n, p in events if n == "content_block_delta")
    delta = events[-2][1]
    plain = client(tiny).messages.create(model=MODEL_NAME, max_tokens=8, messages=body["messages"], extra_body=GREEDY)
    assert text == plain.content[0].text
    assert delta["delta"] == {"stop_reason": plain.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens


def test_multi_turn_with_a_system_prompt_renders_the_chat_template(tiny):
    c = client(tiny)
    msg = c.messages.create(model=MODEL_NAME, max_tokens=4, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    expected = prompt_tokens(tiny, [("system", SYSTEM), ("user", "Who made the heaven?"), ("assistant", "God made it."),
                                    ("user", "And the earth?")])
    assert msg.usage.input_tokens == expected
    blocks = c.messages.create(model=MODEL_NAME, max_tokens=4, messages=TURNS, extra_body=GREEDY,
                               system=[{"type": "text", "text": "You answer in the words "},
                                       {"type": "text", "text": "of the book.", "cache_control": {"type": "ephemeral"}}])
    assert blocks.usage.input_tokens == expected and blocks.content[0].text == msg.content[0].text
    count = c.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=TURNS)
    assert count.input_tokens == expected


def test_count_tokens_equals_the_input_tokens_of_the_message(tiny):
    c = client(tiny)
    messages = [{"role": "user", "content": "And God said, Let there be light"}]
    counted = c.messages.count_tokens(model=MODEL_NAME, messages=messages)
    msg = c.messages.create(model=MODEL_NAME, max_tokens=2, messages=messages, extra_body=GREEDY)
    assert counted.input_tokens == msg.usage.input_tokens > 0


def test_stop_sequences_end_the_message_with_the_sequence_matched(tiny):
    c = client(tiny)
    messages = [{"role": "user", "content": "In the beginning"}]
    full = c.messages.create(model=MODEL_NAME, max_tokens=24, messages=messages, extra_body=GREEDY).content[0].text
    assert len(full) >= 8, full
    seq = full[4:7]                                  # met after some text: what comes before it is sent
    expected = full[:full.find(seq)]
    msg = c.messages.create(model=MODEL_NAME, max_tokens=24, messages=messages, extra_body=GREEDY,
                            stop_sequences=["never seen \u2603", seq])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", seq)
    assert msg.content[0].text == expected
    with c.messages.stream(model=MODEL_NAME, max_tokens=24, messages=messages, extra_body=GREEDY,
                           stop_sequences=[seq]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", seq, expected)


def test_max_tokens_stops_the_message(tiny):
    c, messages = client(tiny), [{"role": "user", "content": "And"}]
    msg = c.messages.create(model=MODEL_NAME, max_tokens=2, messages=messages, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2 and msg.stop_sequence is None
    # sampled (no seed on this route): the end of turn (a token, counted) may be drawn among the first two; max_tokens
    # is never passed, and a message shorter than it ended its turn
    for _ in range(4):
        msg = c.messages.create(model=MODEL_NAME, max_tokens=2, messages=messages,
                                extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20})
        assert msg.stop_sequence is None and 1 <= msg.usage.output_tokens <= 2, msg
        assert msg.stop_reason in (("max_tokens", "end_turn") if msg.usage.output_tokens == 2 else ("end_turn",)), msg


# ---------------------------------------------------------------- fake engine: exact texts, failures

def test_stop_sequence_and_max_tokens_on_known_text(fake):
    c = client(fake)
    msg = c.messages.create(model=MODEL_NAME, max_tokens=100, messages=[{"role": "user", "content": "x"}],
                            stop_sequences=["lazy", "quick"])
    assert msg.content[0].text == "Hello world! The " and msg.stop_sequence == "quick"
    msg = c.messages.create(model=MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert msg.content[0].text == FAKE_TEXT[:5] and msg.stop_reason == "max_tokens"


def test_an_engine_failure_mid_stream_is_an_error_event(fake):
    fake.engine.fail_next_steps = 1
    body = {"model": MODEL_NAME, "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    status, data, _ = raw(fake, "POST", "/v1/messages", json.dumps(body))
    events = sse_events(data)
    assert status == 200 and [n for n, _ in events] == ["message_start", "content_block_start", "ping", "error"]
    error = events[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "simulated CUDA error" in error["error"]["message"]
    fake.engine.fail_next_steps = 1
    with pytest.raises(anthropic.InternalServerError, match="simulated CUDA error"):
        client(fake).messages.create(model=MODEL_NAME, max_tokens=5, messages=body["messages"])
    assert client(fake).messages.create(model=MODEL_NAME, max_tokens=5,
                                        messages=body["messages"]).content[0].text == "Hello"


def test_a_draining_server_is_overloaded_and_may_be_retried(fake):
    service = fake.server.service
    asyncio.run_coroutine_threadsafe(service.drain(0.0), fake.server.loop).result(10)
    try:
        status, data, headers = raw(fake, "POST", "/v1/messages", json.dumps(MESSAGE))
    finally:
        service.resume()
    assert status == 503 and headers.get("Retry-After") == "1"
    assert json.loads(data)["error"]["type"] == "overloaded_error"


# ---------------------------------------------------------------- auth

def test_the_key_goes_in_x_api_key_or_bearer_on_every_route(tmp_path, monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with live_server(tmp_path, api_key="s3cret", grpc=False) as ls:
        by_header = client(ls, api_key=None, default_headers={"x-api-key": "s3cret"})
        assert by_header.messages.create(model=MODEL_NAME, max_tokens=3, messages=MESSAGE["messages"]).content
        by_bearer = client(ls, api_key=None, auth_token="s3cret")
        assert by_bearer.messages.count_tokens(model=MODEL_NAME, messages=MESSAGE["messages"]).input_tokens > 0
        assert raw(ls, "GET", "/v1/models", headers={"x-api-key": "s3cret"})[0] == 200
        assert raw(ls, "POST", "/v1/messages", json.dumps(MESSAGE), {"Authorization": "Bearer s3cret"})[0] == 200
        with pytest.raises(anthropic.AuthenticationError) as info:
            client(ls, api_key=None, default_headers={"x-api-key": "wrong"}).messages.create(
                model=MODEL_NAME, max_tokens=3, messages=MESSAGE["messages"])
        assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"x-api-key": "Bearer s3cret"}):
            status, data, _ = raw(ls, "POST", "/v1/messages/count_tokens", json.dumps(MESSAGE), headers)
            assert status == 401 and json.loads(data) == {"type": "error", "error": {
                "type": "authentication_error", "message": json.loads(data)["error"]["message"]}}
            assert "x-api-key" in json.loads(data)["error"]["message"]
        status, data, _ = raw(ls, "GET", "/v1/models", headers={"x-api-key": "wrong"})
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"     # OpenAI's shape there
        port = int(ls.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:     # a key that is not UTF-8
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-api-key: s3\xffcret\r\nConnection: close\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 401")


# ---------------------------------------------------------------- bad input: 4xx in Anthropic's shape

MESSAGE = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
USER = MESSAGE["messages"]
ERROR_CASES = {   # body, status, error type, words the message must hold (the field, what is valid)
    "malformed-json": ('{"model": "tiny-test", "messages": ', 400, "invalid_request_error", ["not valid JSON"]),
    "not-an-object": ("[1, 2]", 400, "invalid_request_error", ["JSON object"]),
    "missing-max-tokens": ({k: v for k, v in MESSAGE.items() if k != "max_tokens"}, 400, "invalid_request_error",
                           ["'max_tokens' is required", "integer >= 1"]),
    "zero-max-tokens": ({**MESSAGE, "max_tokens": 0}, 400, "invalid_request_error", ["max_tokens", ">= 1"]),
    "max-tokens-over-context": ({**MESSAGE, "max_tokens": CONTEXT_LENGTH}, 400, "invalid_request_error",
                                ["max_tokens", "at most"]),
    "missing-model": ({k: v for k, v in MESSAGE.items() if k != "model"}, 400, "invalid_request_error", ["'model'"]),
    "unknown-model": ({**MESSAGE, "model": "claude-9"}, 404, "not_found_error", ["claude-9", MODEL_NAME]),
    "bad-role": ({**MESSAGE, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error",
                 ["messages[0].role", "'user' or 'assistant'"]),
    "system-role": ({**MESSAGE, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
                    ["messages[0].role", "top-level 'system'"]),
    "no-messages": ({**MESSAGE, "messages": []}, 400, "invalid_request_error", ["'messages'", "non-empty list"]),
    "content-not-text": ({**MESSAGE, "messages": [{"role": "user", "content": 7}]}, 400, "invalid_request_error",
                         ["messages[0].content", "string or a list of content blocks"]),
    "empty-content": ({**MESSAGE, "messages": [{"role": "user", "content": []}]}, 400, "invalid_request_error",
                      ["messages[0].content", "non-empty text"]),
    "image-block": ({**MESSAGE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
        400, "invalid_request_error", ["messages[0].content[1]", "'image'", "'text'"]),
    "document-block": ({**MESSAGE, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
        400, "invalid_request_error", ["messages[0].content[0]", "'document'"]),
    "tool-result-unanswered": ({**MESSAGE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]}, 400, "invalid_request_error",
        ["messages[0].content[0].tool_use_id", "earlier assistant turn", "'t1'"]),
    "tool-use-from-the-user": ({**MESSAGE, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, 400, "invalid_request_error",
        ["messages[0].content[0]", "only an assistant turn"]),
    "unknown-block": ({**MESSAGE, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
                      "invalid_request_error", ["messages[0].content[0]", "'hologram'", "'text'"]),
    "text-not-string": ({**MESSAGE, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, 400,
                        "invalid_request_error", ["messages[0].content[0].text", "string"]),
    "image-in-system": ({**MESSAGE, "system": [{"type": "image", "source": {}}]}, 400, "invalid_request_error",
                        ["system[0]", "'image'"]),
    "prefill": ({**MESSAGE, "messages": USER + [{"role": "assistant", "content": "The answer is"}]}, 400,
                "invalid_request_error", ["messages[1].role", "prefill"]),
    "tools": ({**MESSAGE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
              "invalid_request_error", ["'tools[0].type'", "server tools"]),
    "tool-choice-any": ({**MESSAGE, "tool_choice": {"type": "any"}}, 400, "invalid_request_error",
                        ["'tool_choice'", "needs 'tools'"]),
    "thinking": ({**MESSAGE, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error",
                 ["'thinking'", "disabled"]),
    "structured-output": ({**MESSAGE, "output_config": {"format": {"type": "json_schema", "schema": {}}}}, 400,
                          "invalid_request_error", ["'output_config.format'"]),
    "stop-sequences-not-strings": ({**MESSAGE, "stop_sequences": [1]}, 400, "invalid_request_error",
                                   ["'stop_sequences'", "list of strings"]),
    "negative-temperature": ({**MESSAGE, "temperature": -1}, 400, "invalid_request_error", ["'temperature'", ">= 0"]),
    "top-p-zero": ({**MESSAGE, "top_p": 0}, 400, "invalid_request_error", ["'top_p'", "(0, 1]"]),
    "stream-not-bool": ({**MESSAGE, "stream": "yes"}, 400, "invalid_request_error", ["'stream'", "true or false"]),
    "metadata-extra-key": ({**MESSAGE, "metadata": {"session": "x"}}, 400, "invalid_request_error",
                           ["metadata.session", "'user_id'"]),
    "lone-surrogate": ('{"model": "tiny-test", "max_tokens": 4, "messages": [{"role": "user", "content": "x\\ud83d"}]}',
                       400, "invalid_request_error", ["messages[0].content", "surrogate"]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES), ids=list(ERROR_CASES))
def test_bad_requests_get_a_4xx_in_anthropics_error_shape_naming_the_field(fake, case):
    body, status, kind, words = ERROR_CASES[case]
    got, data, headers = raw(fake, "POST", "/v1/messages", body if isinstance(body, str) else json.dumps(body))
    assert got == status, data
    assert headers["Content-Type"].startswith("application/json")
    doc = json.loads(data)
    assert set(doc) == {"type", "error"} and doc["type"] == "error" and set(doc["error"]) == {"type", "message"}
    assert doc["error"]["type"] == kind
    for word in words:
        assert word in doc["error"]["message"], (word, doc["error"]["message"])


def test_count_tokens_checks_what_messages_checks_but_max_tokens(fake):
    body = {k: v for k, v in MESSAGE.items() if k != "max_tokens"}
    status, data, _ = raw(fake, "POST", "/v1/messages/count_tokens", json.dumps(body))
    assert status == 200 and json.loads(data) == {"input_tokens": prompt_tokens(fake, [("user", "hi")])}
    for case in ("tools", "image-block", "bad-role", "unknown-model"):
        case_body, case_status, kind, words = ERROR_CASES[case]
        status, data, _ = raw(fake, "POST", "/v1/messages/count_tokens", json.dumps(case_body))
        assert status == case_status and json.loads(data)["error"]["type"] == kind, (case, data)


def test_the_client_raises_the_errors_with_their_type(fake):
    with pytest.raises(anthropic.BadRequestError) as info:
        client(fake).messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client(fake).messages.create(model="claude-9", max_tokens=4, messages=USER)


def test_unknown_routes_and_methods_under_messages_answer_in_anthropics_shape(fake):
    status, data, _ = raw(fake, "GET", "/v1/messages")
    assert status == 405 and json.loads(data)["error"]["type"] == "invalid_request_error"
    status, data, _ = raw(fake, "POST", "/v1/messages/batches", json.dumps(MESSAGE))
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error"
    status, data, _ = raw(fake, "POST", "/v1/messages", b"x" * (9 << 20))
    assert status == 413 and json.loads(data)["error"]["type"] == "request_too_large"
    status, data, _ = raw(fake, "POST", "/v1/chat/completions", "{")      # the OpenAI routes keep theirs
    assert status == 400 and set(json.loads(data)["error"]) == {"message", "type", "param", "code"}
