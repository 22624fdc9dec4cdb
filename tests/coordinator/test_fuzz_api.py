"""Fuzz the live HTTP API (127.0.0.1 only, bounded count and time): random JSON, mutated valid
requests and raw garbage. Every answer must be a well-formed success or a 4xx/503 in OpenAI's error
shape (never a 500, never a hang), and the server must answer correctly afterwards."""
from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import FAKE_TEXT, MODEL_NAME, live_server  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("FT_FUZZ_EXAMPLES", "250"))
ALLOWED_ERRORS = {400, 404, 405, 413, 503}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 8}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "seed", "n", "stop", "stream", "stream_options", "ignore_eos", "stop_token_ids", "logprobs", "echo",
        "best_of", "presence_penalty", "logit_bias", "tools", "response_format", "user", "suffix"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # few pending requests so that a fuzzed n * prompts cannot queue thousands of generations
    with live_server(tmp_path_factory.mktemp("fuzz"), max_pending_requests=16, grpc=False,
                     request_timeout_s=20) as ls:
        yield ls


json_leaf = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24))
json_value = st.recursive(json_leaf, lambda children: st.lists(children, max_size=4)
                          | st.dictionaries(st.text(max_size=12), children, max_size=4), max_leaves=16)
small_ints = st.integers(min_value=-3, max_value=40)
# values near the edges of what each field accepts
edge_value = st.one_of(json_value, small_ints, st.floats(min_value=-1, max_value=3), st.sampled_from(
    [MODEL_NAME, "", "x" * 300, [1, 2, 3], [[1, 2], [3]], ["a", "b"], [{"role": "user", "content": "x"}],
     [{"role": "user", "content": [{"type": "text", "text": "y"}]}], {"include_usage": True}, True, False]))


@st.composite
def mutated_request(draw):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = dict(COMPLETION if path == "/v1/completions" else CHAT)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["set", "set", "delete", "unknown"]))
        key = draw(st.sampled_from(KEYS))
        if op == "set":
            body[key] = draw(edge_value)
        elif op == "delete":
            body.pop(key, None)
        else:
            body[draw(st.text(min_size=1, max_size=8))] = draw(json_value)
    return path, json.dumps(body).encode()


raw_body = st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode()),
                     st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
any_request = st.one_of(mutated_request(),
                        st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw_body))


def post(port: int, path: str, body: bytes) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def check_answer(status: int, headers: dict, data: bytes) -> None:
    if status == 200:
        if headers["content-type"].startswith("text/event-stream"):
            events = [e for e in data.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]", events[-3:]
            for e in events[:-1]:
                assert e.startswith("data: ")
                payload = json.loads(e[6:])
                assert "choices" in payload or "error" in payload
                assert "error" not in payload, payload
        else:
            payload = json.loads(data)
            assert payload["object"] in ("text_completion", "chat.completion") and payload["choices"]
            assert payload["usage"]["total_tokens"] == (payload["usage"]["prompt_tokens"]
                                                        + payload["usage"]["completion_tokens"])
        return
    assert status in ALLOWED_ERRORS, (status, data[:300])
    err = json.loads(data)["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_fuzzed_requests_get_well_formed_answers_and_the_server_keeps_working(server):
    port = int(server.base_url.rsplit(":", 1)[1])
    started = time.monotonic()
    statuses: dict[int, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(any_request)
    def one(request):
        if time.monotonic() - started > 90:          # hard bound on the whole fuzz run
            return
        path, body = request
        answer = post(port, path, body)
        statuses[answer[0]] = statuses.get(answer[0], 0) + 1
        check_answer(*answer)

    one()
    print("fuzz statuses:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= min(FUZZ_EXAMPLES, 50) and statuses.get(200, 0) > 0
    assert_still_serving(server, port)


def assert_still_serving(server, port: int) -> None:
    status, _, data = post(port, "/v1/completions", json.dumps({**COMPLETION, "max_tokens": 5}).encode())
    assert status == 200 and json.loads(data)["choices"][0]["text"] == FAKE_TEXT[:5]
    server.wait_for(lambda: not server.server.service.live and not server.engine.running and not server.engine.waiting,
                    what="no request left behind")


@pytest.mark.parametrize("garbage", [
    b"\x00\x01\x02\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{\"a\"",       # body cut short, then close
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 500 + b"\r\n",
], ids=["binary", "bad-version", "huge-length", "bad-chunk", "short-body", "long-line", "many-headers"])
def test_raw_garbage_does_not_disturb_the_server(server, garbage):
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
        try:
            reply = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            reply = b""
    assert reply == b"" or reply.startswith(b"HTTP/1.1 4") or reply.startswith(b"HTTP/1.0 4"), reply[:100]
    assert_still_serving(server, port)
