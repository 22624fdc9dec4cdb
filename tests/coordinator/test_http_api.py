"""The OpenAI-compatible HTTP API against a live server on 127.0.0.1: the official `openai` client
for the happy paths (real tiny engine and the fake engine), raw HTTP for errors and disconnects."""
from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading

import openai
import pytest
from ftexpert.coordinator.text_codec import ChatMessage

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import CONTEXT_LENGTH, FAKE_TEXT, MODEL_NAME, live_server  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("tiny"), real_engine=True) as ls:
        yield ls


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("fake"), engine_kwargs={"max_running": 4}) as ls:
        yield ls


def client(ls, api_key="unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=ls.base_url + "/v1", api_key=api_key, max_retries=0, timeout=30)


def raw(ls, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", int(ls.base_url.rsplit(":", 1)[1]), timeout=30)
    try:
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, data, dict(resp.getheaders())
    finally:
        conn.close()


def post_json(ls, path, obj, headers=None):
    status, data, _ = raw(ls, "POST", path, json.dumps(obj), headers)
    return status, json.loads(data)


# ---------------------------------------------------------------- real tiny engine, openai client

def test_models_lists_the_served_model(tiny):
    models = client(tiny).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_usage_counts_and_stream_equals_non_stream(tiny):
    c = client(tiny)
    prompt = "The quick brown fox"
    prompt_tokens = len(tiny.server.model.codec.encode(prompt))
    full = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == prompt_tokens + 12
    assert full.choices[0].finish_reason == "length"
    pieces, usage = [], None
    for chunk in c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
    assert "".join(pieces) == full.choices[0].text        # greedy: same tokens either way
    assert usage.completion_tokens == 12 and usage.prompt_tokens == prompt_tokens


def test_chat_uses_the_template_and_seeded_sampling_repeats(tiny):
    c = client(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    expected_prompt = tiny.server.model.codec.encode_chat(
        [ChatMessage(m["role"], m["content"]) for m in messages])
    a = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.9,
                                  top_p=0.9, seed=1234, extra_body={"top_k": 50, "ignore_eos": True})
    b = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.9,
                                  top_p=0.9, seed=1234, extra_body={"top_k": 50, "ignore_eos": True})
    assert a.usage.prompt_tokens == len(expected_prompt)
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 16


def test_chat_stream_has_role_then_content_then_finish(tiny):
    chunks = list(client(tiny).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_n_choices_and_batched_prompts(tiny):
    r = client(tiny).completions.create(model=MODEL_NAME, prompt=["one", "two words"], n=2, max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text              # same prompt, greedy
    assert r.usage.completion_tokens == 16


# ---------------------------------------------------------------- fake engine: stop strings, faults

def test_stop_string_is_not_emitted_and_the_engine_request_is_aborted(fake):
    c = client(fake)
    r = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100, stop=["fox"])
    assert r.choices[0].text == "Hello world! The quick brown "
    assert r.choices[0].finish_reason == "stop"
    fake.wait_for(lambda: not fake.engine.running, what="engine slots freed after the stop string")
    pieces = []
    for chunk in c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=100, stop=["zzz", "brown f"],
                                      stream=True):
        pieces.append(chunk.choices[0].text)
        assert "b" not in chunk.choices[0].text or "brown" not in "".join(pieces)
    assert "".join(pieces) == "Hello world! The quick "


def test_stop_string_prefix_at_the_end_is_released(fake):
    # "Hel" could start "Help" until the text ends: then it is ordinary text.
    r = client(fake).completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, stop=["Help"])
    assert r.choices[0].text == "Hel" and r.choices[0].finish_reason == "length"


def test_client_disconnect_mid_stream_aborts_the_engine_request(tmp_path):
    with live_server(tmp_path, engine_kwargs={"step_delay_s": 0.02}) as ls:
        port = int(ls.base_url.rsplit(":", 1)[1])
        body = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 200, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(4096)
        assert b"200 OK" in got
        sock.close()
        ls.wait_for(lambda: ls.engine.aborted, what="engine.abort after the client left")
        ls.wait_for(lambda: not ls.engine.running and not ls.server.service.live, what="slots freed")
        assert ls.engine.requests[ls.engine.aborted[0]].produced < 200
        # and the server still answers
        r = client(ls).completions.create(model=MODEL_NAME, prompt="x", max_tokens=5)
        assert r.choices[0].text == FAKE_TEXT[:5]


def test_concurrent_streams_all_finish_correctly(fake):
    results, errors = {}, []

    def one(i):
        try:
            text = "".join(ch.choices[0].text for ch in client(fake).completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=10 + i, stream=True))
            results[i] = text
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert results == {i: (FAKE_TEXT * 2)[:10 + i] for i in range(8)}


def test_engine_failure_fails_the_requests_in_flight_then_recovers(tmp_path):
    with live_server(tmp_path, engine_kwargs={"step_delay_s": 0.01}) as ls:
        c = client(ls)
        ls.engine.fail_next_steps = 1
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5)
        assert "simulated CUDA error" in str(info.value)
        r = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5)
        assert r.choices[0].text == "Hello"
        status, body, _ = raw(ls, "GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert ls.server.service.requests_failed_total == 1


def test_an_engine_whose_steps_keep_failing_stops_then_answers_503_until_restarted(tmp_path):
    import asyncio

    with live_server(tmp_path) as ls:
        c = client(ls)
        first = ls.engine
        first.fail_next_steps = 3                      # the worker loop's MAX_STEP_FAILURES in a row
        for _ in range(3):
            with pytest.raises(openai.InternalServerError, match="simulated CUDA error"):
                c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5)
        ls.wait_for(lambda: not ls.server.service.engine_healthy, what="the engine loop to stop")
        status, body, _ = raw(ls, "GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "engine_failed"
        assert "its steps kept failing" in json.loads(body)["error"]
        status, body, headers = raw(ls, "POST", "/v1/completions", json.dumps(BASE))
        error = json.loads(body)["error"]
        # nothing restarts it: the client is told so, not to retry (no Retry-After)
        assert status == 503 and error["code"] == "engine_failed" and "Retry-After" not in headers, (error, headers)
        assert "retry in" not in error["message"] and "ft ctl restart engine" in error["message"]
        asyncio.run_coroutine_threadsafe(ls.server.service.restart_engine(), ls.server.loop).result(30)
        assert ls.engine is not first and ls.server.service.engine_healthy
        assert c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5).choices[0].text == "Hello"
        assert ls.server.service.worker_info()[0]["restarts"] == 1


def test_health_and_metrics(fake):
    client(fake).completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4)
    status, body, _ = raw(fake, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body, headers = raw(fake, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for series in ("ft_generation_tokens_total", "ft_generation_tokens_per_second", "ft_expert_hit_ratio",
                   "ft_expert_misses_per_token", "ft_experts_fetched_total", "ft_experts_cpu_total",
                   "ft_pcie_gigabytes_per_second", "ft_cpu_expert_seconds_total", "ft_requests_waiting",
                   "ft_fetch_fraction", "ft_time_to_first_token_seconds_bucket", 'ft_engine_stat{name="num_running"}'):
        assert f"\n{series}" in text, series
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["ft_expert_hit_ratio"] == pytest.approx(0.75)          # the fake: 6 hits, 2 misses a token
    assert values["ft_expert_misses_per_token"] == pytest.approx(2.0)
    assert values["ft_pcie_gigabytes_per_second"] == pytest.approx(20.0)  # 1 MB per 50 us
    assert values["ft_generation_tokens_total"] >= 4
    assert values['ft_http_requests_total{route="/v1/completions",code="200"}'] >= 1


# ---------------------------------------------------------------- bad input: clear 4xx, others unharmed

def _error_case(body: dict | str, status: int, param: str | None, code: str | None = None, path="/v1/completions"):
    return (body, status, param, code, path)


BASE = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ERROR_CASES = {
    "malformed-json": ('{"model": "tiny-test", "prompt": ', 400, None, None, "/v1/completions"),
    "json-not-object": ("[1, 2, 3]", 400, None, None, "/v1/completions"),
    "nan-literal": ('{"model": "tiny-test", "prompt": "hi", "temperature": NaN}', 400, None, None, "/v1/completions"),
    "unknown-model": ({**BASE, "model": "gpt-5"}, 404, "model", "model_not_found", "/v1/completions"),
    "missing-model": ({"prompt": "hi"}, 400, "model", None, "/v1/completions"),
    "prompt-longer-than-context": ({**BASE, "prompt": "a" * (CONTEXT_LENGTH + 5)}, 400, "prompt",
                                   "context_length_exceeded", "/v1/completions"),
    "prompt-plus-max-tokens-over-context": ({**BASE, "max_tokens": CONTEXT_LENGTH}, 400, "max_tokens",
                                            "context_length_exceeded", "/v1/completions"),
    "negative-max-tokens": ({**BASE, "max_tokens": -1}, 400, "max_tokens", None, "/v1/completions"),
    "zero-max-tokens": ({**BASE, "max_tokens": 0}, 400, "max_tokens", None, "/v1/completions"),
    "bool-max-tokens": ({**BASE, "max_tokens": True}, 400, "max_tokens", None, "/v1/completions"),
    "negative-temperature": ({**BASE, "temperature": -0.5}, 400, "temperature", None, "/v1/completions"),
    "string-temperature": ({**BASE, "temperature": "hot"}, 400, "temperature", None, "/v1/completions"),
    "top-p-zero": ({**BASE, "top_p": 0}, 400, "top_p", None, "/v1/completions"),
    "top-p-above-one": ({**BASE, "top_p": 1.5}, 400, "top_p", None, "/v1/completions"),
    "top-k-negative": ({**BASE, "top_k": -2}, 400, "top_k", None, "/v1/completions"),
    "seed-float": ({**BASE, "seed": 1.5}, 400, "seed", None, "/v1/completions"),
    "n-zero": ({**BASE, "n": 0}, 400, "n", None, "/v1/completions"),
    "stop-not-strings": ({**BASE, "stop": [1, 2]}, 400, "stop", None, "/v1/completions"),
    "token-id-out-of-vocab": ({**BASE, "prompt": [1, 2, 10 ** 9]}, 400, "prompt", None, "/v1/completions"),
    "empty-prompt": ({**BASE, "prompt": ""}, 400, "prompt", None, "/v1/completions"),
    "logprobs-above-five": ({**BASE, "logprobs": 6}, 400, "logprobs", None, "/v1/completions"),
    "logprobs-not-integer": ({**BASE, "logprobs": True}, 400, "logprobs", None, "/v1/completions"),
    "stream-options-without-stream": ({**BASE, "stream_options": {"include_usage": True}}, 400, "stream_options",
                                      None, "/v1/completions"),
    "chat-empty-messages": ({**CHAT, "messages": []}, 400, "messages", None, "/v1/chat/completions"),
    "chat-bad-role": ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None,
                      "/v1/chat/completions"),
    "chat-image-part": ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
                        "messages[0].content", None, "/v1/chat/completions"),
    "chat-tools": ({**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function", None,
                   "/v1/chat/completions"),
    "chat-tools-template": ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
                            "unsupported_parameter", "/v1/chat/completions"),      # its template renders no tools
    "chat-max-completion-tokens-negative": ({**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens",
                                            None, "/v1/chat/completions"),
    "chat-logprobs-not-bool": ({**CHAT, "logprobs": 1}, 400, "logprobs", None, "/v1/chat/completions"),
    "chat-top-logprobs-above-20": ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None,
                                   "/v1/chat/completions"),
    "chat-top-logprobs-negative": ({**CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", None,
                                   "/v1/chat/completions"),
    "chat-top-logprobs-without-logprobs": ({**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None,
                                           "/v1/chat/completions"),
    "chat-response-format-not-object": ({**CHAT, "response_format": "json"}, 400, "response_format", None,
                                        "/v1/chat/completions"),
    "chat-response-format-unknown-type": ({**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type",
                                          None, "/v1/chat/completions"),
    "chat-json-schema-missing": ({**CHAT, "response_format": {"type": "json_schema"}}, 400,
                                 "response_format.json_schema", None, "/v1/chat/completions"),
    "chat-json-schema-bad-name": ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "has spaces", "schema": {"type": "object"}}}}, 400, "response_format.json_schema.name", None,
        "/v1/chat/completions"),
    "chat-json-schema-not-object": ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, 400, "response_format.json_schema.schema", None, "/v1/chat/completions"),
    "chat-json-schema-bad-type": ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400,
        "response_format.json_schema.schema", "invalid_json_schema", "/v1/chat/completions"),
    "completion-json-schema-unsatisfiable": ({**BASE, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 2}}}}, 400,
        "response_format.json_schema.schema", "invalid_json_schema", "/v1/completions"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES), ids=list(ERROR_CASES))
def test_bad_requests_get_a_clear_4xx_in_openai_error_shape(fake, case):
    body, status, param, code, path = ERROR_CASES[case]
    got_status, data, headers = raw(fake, "POST", path, body if isinstance(body, str) else json.dumps(body))
    assert got_status == status, data
    assert headers["Content-Type"].startswith("application/json")
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_errors_leave_other_requests_unharmed(fake):
    results = []
    t = threading.Thread(target=lambda: results.append(client(fake).completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=40)))
    t.start()
    for case in ERROR_CASES.values():
        body, status, *_ , path = case
        assert raw(fake, "POST", path, body if isinstance(body, str) else json.dumps(body))[0] == status
    t.join(30)
    assert results and results[0].choices[0].text == (FAKE_TEXT * 2)[:40]


def test_unknown_route_method_and_oversized_body(fake):
    status, data, _ = raw(fake, "GET", "/v2/nothing")
    assert status == 404 and "error" in json.loads(data)
    status, data, _ = raw(fake, "GET", "/v1/completions")
    assert status == 405 and json.loads(data)["error"]["message"].startswith("GET is not allowed")
    status, data, _ = raw(fake, "POST", "/v1/completions", b"x" * (9 << 20))
    assert status == 413 and "error" in json.loads(data)


def test_get_model_by_id(fake):
    status, data, _ = raw(fake, "GET", f"/v1/models/{MODEL_NAME}")
    assert status == 200 and json.loads(data)["id"] == MODEL_NAME
    status, data, _ = raw(fake, "GET", "/v1/models/other")
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- security

def test_api_key_guards_http_but_not_health(tmp_path):
    with live_server(tmp_path, api_key="s3cret", grpc=False) as ls:
        status, data, headers = raw(ls, "GET", "/v1/models")
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
        assert headers.get("WWW-Authenticate") == "Bearer"
        assert raw(ls, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert raw(ls, "GET", "/metrics")[0] == 401
        assert raw(ls, "POST", "/v1/completions", json.dumps(BASE))[0] == 401
        assert raw(ls, "GET", "/health")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            client(ls, api_key="wrong").models.list()
        assert client(ls, api_key="s3cret").completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)


def test_listeners_bind_loopback_by_default_and_refuse_exposure_without_token():
    from ftexpert.coordinator.auth import check_exposure, is_loopback
    from ftexpert.coordinator.server import ListenConfig
    from ftexpert.coordinator.serve_cli import add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and ListenConfig().host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert check_exposure("127.0.0.1", None, "HTTP API") is None
    assert check_exposure("0.0.0.0", "token", "HTTP API") is None
    with pytest.raises(ValueError, match="no API key"):
        check_exposure("0.0.0.0", None, "HTTP API")
    assert "no API key is set (--insecure)" in check_exposure("0.0.0.0", None, "HTTP API", insecure=True)


# ---------------------------------------------------------------- drain

def test_drain_finishes_in_flight_and_refuses_new_requests(tmp_path):
    import asyncio

    with live_server(tmp_path, engine_kwargs={"step_delay_s": 0.01}) as ls:
        done = []
        t = threading.Thread(target=lambda: done.append(client(ls).completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=30)))
        t.start()
        ls.wait_for(lambda: ls.engine.running, what="request running")
        fut = asyncio.run_coroutine_threadsafe(ls.server.service.drain(10.0), ls.server.loop)
        ls.wait_for(lambda: ls.server.service.draining, what="draining")
        status, data, _ = raw(ls, "POST", "/v1/completions", json.dumps(BASE))
        assert status == 503 and json.loads(data)["error"]["type"] == "service_unavailable"
        assert raw(ls, "GET", "/health")[0] == 503
        assert fut.result(15) == (1, 0)
        t.join(10)
        assert done and done[0].choices[0].finish_reason == "length"
        ls.server.service.resume()
        assert raw(ls, "POST", "/v1/completions", json.dumps(BASE))[0] == 200
