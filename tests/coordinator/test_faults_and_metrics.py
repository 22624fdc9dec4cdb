"""Faults as clients and operators see them (in-process servers around the fake engine): 503s that may be
retried carry Retry-After; a given-up engine says so, and by default the coordinator exits; /metrics in the
Prometheus format with counters as counters, worker state, and each process's memory and open files."""
from __future__ import annotations

import http.client
import json
import os
import sys
import threading

from ftexpert.coordinator.metrics import render_prometheus
from ftexpert.coordinator.server import EXIT_WORKERS_GAVE_UP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from coordinator_support import MODEL_NAME, live_server  # noqa: E402


def request(ls, method: str, path: str, body: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", int(ls.base_url.rsplit(":", 1)[1]), timeout=30)
    try:
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), dict(resp.getheaders())
    finally:
        conn.close()


def completion(max_tokens: int = 4) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": max_tokens}


def test_the_queue_limit_answers_503_with_retry_after(tmp_path):
    with live_server(tmp_path, max_pending_requests=1, engine_kwargs={"step_delay_s": 0.05}) as ls:
        first = threading.Thread(target=request, args=(ls, "POST", "/v1/completions", completion(40)))
        first.start()
        ls.wait_for(lambda: ls.server.service.live, what="the first request")
        status, body, headers = request(ls, "POST", "/v1/completions", completion())
        first.join()
    assert status == 503 and body["error"]["code"] == "service_unavailable" and headers["Retry-After"] == "1"


def test_a_drained_request_is_engine_unavailable_with_retry_after(tmp_path):
    import asyncio

    with live_server(tmp_path, engine_kwargs={"step_delay_s": 0.05}) as ls:
        out: list = []
        t = threading.Thread(target=lambda: out.append(request(ls, "POST", "/v1/completions", completion(200))))
        t.start()
        ls.wait_for(lambda: ls.server.service.requests_running or ls.server.service.live, what="the request")
        asyncio.run_coroutine_threadsafe(ls.server.service.drain(0.1), ls.server.loop).result(10)
        t.join()
        ls.server.service.resume()
    status, body, headers = out[0]
    assert status == 503 and body["error"]["code"] == "engine_unavailable" and headers["Retry-After"] == "1", body
    assert "drained" in body["error"]["message"]


def test_a_given_up_engine_is_reported_truthfully_when_told_to_stay_up(tmp_path):
    with live_server(tmp_path) as ls:
        ls.server.listen.exit_on_worker_give_up = False
        ls.server.worker_gave_up("gpu0", "worker gpu0 failed 6 times in a row; not restarting it again",
                                 gpu_worker=True)
        ls.wait_for(lambda: ls.server.service.engine_gave_up is not None, what="the give-up")
        ls.server.service.engine._session = 0          # the worker is gone (its session was lost)
        status, body, _ = request(ls, "GET", "/health")
        assert status == 503 and body["status"] == "engine_failed" and "6 times in a row" in body["error"]
        status, body, headers = request(ls, "POST", "/v1/completions", completion())
        assert status == 503 and body["error"]["code"] == "engine_failed" and "Retry-After" not in headers
        assert "retry" not in body["error"]["message"].lower()
        status, text, headers = _metrics(ls)
        assert "\nft_supervisor_gave_up 1.0" in text
        assert not ls.server._closed.is_set() and ls.server.exit_code == 0


def test_by_default_a_give_up_drains_stops_and_sets_exit_code_70(tmp_path):
    with live_server(tmp_path) as ls:
        ls.server.worker_gave_up("gpu0", "worker gpu0 failed 6 times in a row", gpu_worker=True)
        ls.wait_for(lambda: ls.server._closed.is_set(), what="the coordinator to stop")
        assert ls.server.exit_code == EXIT_WORKERS_GAVE_UP == 70


def test_serve_flag_and_config_field_for_the_give_up_policy():
    import argparse

    from ftexpert.coordinator.serve_cli import add_arguments, listen_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert listen_config(parser.parse_args([])).exit_on_worker_give_up is True
    assert listen_config(parser.parse_args(["--on-worker-give-up", "stay"])).exit_on_worker_give_up is False


def _metrics(ls):
    conn = http.client.HTTPConnection("127.0.0.1", int(ls.base_url.rsplit(":", 1)[1]), timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        return resp.status, resp.read().decode(), dict(resp.getheaders())
    finally:
        conn.close()


def _types(text: str) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_metrics_are_prometheus_text_with_counters_as_counters(tmp_path):
    with live_server(tmp_path) as ls:
        assert request(ls, "POST", "/v1/completions", completion())[0] == 200
        status, text, headers = _metrics(ls)
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    types = _types(text)
    assert types["ft_engine_counter_total"] == "counter" and types["ft_engine_stat"] == "gauge"
    for name, kind in types.items():             # a family is a counter exactly when its name ends in _total
        if kind != "histogram":
            assert (kind == "counter") == name.endswith("_total"), (name, kind)
    samples = [line for line in text.splitlines() if line.startswith("ft_engine_stat{")]
    assert samples and not any('_total"}' in line for line in samples)        # cumulative stats are counters
    pid = os.getpid()
    assert 'ft_process_resident_memory_bytes{component="coordinator",worker=""}' in text
    assert 'ft_process_open_fds{component="coordinator",worker=""}' in text, pid


def test_metrics_show_each_supervised_worker_its_restarts_state_and_process_figures(tmp_path):
    with live_server(tmp_path) as ls:
        me = os.getpid()
        parent = os.getppid()
        workers = [{"name": "engine", "kind": "in-process", "pid": me, "state": "ready", "restarts": 0},
                   {"name": "gpu0", "kind": "gpu-worker", "pid": parent, "state": "backoff", "restarts": 2},
                   {"name": "cpu0", "kind": "cpu-worker", "pid": 0, "state": "failed", "restarts": 5}]
        text = render_prometheus(ls.server.service, ls.server.http.counters, workers=workers)
    types = _types(text)
    assert types["ft_worker_restarts_total"] == "counter" and types["ft_worker_state"] == "gauge"
    assert 'ft_worker_restarts_total{worker="gpu0",kind="gpu-worker"} 2.0' in text
    assert 'ft_worker_state{worker="gpu0",kind="gpu-worker",state="backoff"} 1.0' in text
    assert 'ft_worker_state{worker="gpu0",kind="gpu-worker",state="ready"} 0.0' in text
    assert "\nft_supervisor_gave_up 1.0" in text                                  # cpu0 failed for good
    assert 'ft_process_resident_memory_bytes{component="gpu-worker",worker="gpu0"}' in text
    assert 'worker="cpu0"}' not in text.split("ft_process_resident_memory_bytes", 1)[1]   # no pid: no figures
