"""`ft serve --workers process` / `--attach` as real processes on 127.0.0.1 with the tiny model (CPU):
the same greedy answers as the inline engine; a GPU worker killed mid-stream fails its requests with a
clear error and is restarted; a separately started worker attaches; a config mismatch and a missing
worker fail fast with names; a killed run's shared-memory store is reclaimed by the next start."""
from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time

import grpc
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, live_server  # noqa: E402
from grpc_support import control_channel  # noqa: E402
from serve_support import TINY_ARGS, Proc, Server, children_pids, pid_alive  # noqa: E402

from ftexpert.proto import control_rpc as rpc  # noqa: E402

PROMPTS = ["Hello", "The weather is", "Question: what is two plus two?"]
LONG_CONTEXT_ARGS = ["--device", "cpu", "--max-context-tokens", "8192", "--max-running-requests", "4"]
LONG_TOKENS = 8000                       # a stream that outlives the kill (~1.5 ms a token on the CI CPU)
CHAT = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy answers of the inline engine (the real tiny engine in this process)."""
    with live_server(tmp_path_factory.mktemp("inline"), real_engine=True, grpc=False) as ls:
        def post(path, body):
            conn = http.client.HTTPConnection("127.0.0.1", ls.server.http_port, timeout=60)
            conn.request("POST", path, json.dumps({"model": MODEL_NAME, **body}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            return json.loads(resp.read())
        completions = {p: post("/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})
                       for p in PROMPTS}
        chat = post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "temperature": 0})
    return {"completions": {p: (b["choices"][0]["text"], b["usage"]) for p, b in completions.items()},
            "chat": chat["choices"][0]["message"]["content"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(["--workers", "process", *LONG_CONTEXT_ARGS], tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield srv.wait_listening()
    finally:
        code = srv.stop()
        assert code == 0, srv.output()[-3000:]


def _stream_events(srv: Server, body: dict, timeout_s: float = 60.0):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "stream": True, **body}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _read_events(resp) -> list[str]:
    return [e for e in resp.read().decode().split("\n\n") if e]


def test_process_mode_answers_like_the_inline_engine(server, reference):
    for prompt in PROMPTS:
        body = server.complete(prompt, 24)
        assert (body["choices"][0]["text"], body["usage"]) == reference["completions"][prompt], prompt
    conn, resp = _stream_events(server, {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0})
    events = _read_events(resp)
    conn.close()
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == reference["completions"][PROMPTS[1]][0]
    status, chat = server.request("POST", "/v1/chat/completions",
                                  {"model": "tiny", "messages": CHAT, "max_tokens": 16, "temperature": 0})
    assert status == 200 and chat["choices"][0]["message"]["content"] == reference["chat"]
    status, models = server.request("GET", "/v1/models")
    assert models["data"][0]["max_model_len"] == 8192         # from the worker's READY facts
    with control_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        listed = rpc.ControlStub(channel).ListWorkers(rpc.msg.ListWorkersRequest(), timeout=10).workers
    workers = {w.name: w for w in listed}
    assert len(workers) == len(listed)
    assert workers["gpu0"].state == "ready" and workers["gpu0"].kind == "gpu-worker"
    assert list(workers) == ["gpu0"]                          # the GPU worker once, by its supervised name
    assert children_pids(server.pid, "worker gpu") == [workers["gpu0"].pid]


def test_gpu_worker_killed_mid_stream_fails_clearly_then_is_restarted(server, reference):
    (old_pid,) = children_pids(server.pid, "worker gpu")
    conn, resp = _stream_events(server, {"prompt": "Hello", "max_tokens": LONG_TOKENS, "ignore_eos": True,
                                         "temperature": 0})
    assert resp.readline().startswith(b"data: ")              # tokens are flowing
    with control_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = rpc.ControlStub(channel)
        sampling = rpc.msg.SamplingOptions(temperature=0, ignore_eos=True)
        gen = stub.Generate(rpc.msg.GenerateRequest(prompt="Hi", max_tokens=LONG_TOKENS, sampling=sampling),
                            timeout=60)
        next(gen)
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            for _ in gen:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "GPU worker gpu0" in info.value.details() and "exited" in info.value.details()
    events = _read_events(resp)
    conn.close()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "engine_unavailable" and f"pid {old_pid}" in error["message"], error
    server.wait_healthy(60)                                   # restarted with back-off, READY again
    body = server.complete(PROMPTS[0], 24)
    assert body["choices"][0]["text"] == reference["completions"][PROMPTS[0]][0]
    (new_pid,) = children_pids(server.pid, "worker gpu")
    assert new_pid != old_pid
    with control_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        workers = {w.name: w for w in rpc.ControlStub(channel).ListWorkers(rpc.msg.ListWorkersRequest(),
                                                                          timeout=10).workers}
    assert workers["gpu0"].restarts >= 1 and "killed by signal 9" in workers["gpu0"].last_error


def private_ipc_addr(tmp_path) -> str:
    """An engine-link address in a 0700 directory of this user (the key file goes beside it)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return f"ipc://{run}/engine.sock"


def test_attach_mode_serves_through_a_separately_started_worker(tmp_path, reference):
    addr = private_ipc_addr(tmp_path)
    # first: it waits; no engine flags: it builds the engine spec the coordinator's WELCOME carries
    worker = Proc(["worker", "gpu", "--engine-addr", addr], tmp_path / "worker.log")
    srv = Server(["--attach", "--engine-addr", addr, "--worker-ready-timeout-s", "60", *TINY_ARGS],
                 tmp_path / "serve.log", grpc=False)
    try:
        srv.wait_listening()
        assert children_pids(srv.pid, "worker gpu") == []     # nothing started by the coordinator
        body = srv.complete(PROMPTS[2], 24)
        assert body["choices"][0]["text"] == reference["completions"][PROMPTS[2]][0]
        assert srv.stop() == 0
        assert worker.wait(20) == 0, worker.output()[-2000:]  # SHUTDOWN from the stopping coordinator
        assert "SHUTDOWN from the coordinator" in worker.output()
    finally:
        srv.kill()
        worker.kill()


def test_attach_without_a_worker_fails_naming_the_missing_peer(tmp_path):
    addr = private_ipc_addr(tmp_path)
    srv = Server(["--attach", "--engine-addr", addr, "--worker-ready-timeout-s", "2", *TINY_ARGS],
                 tmp_path / "serve.log", grpc=False)
    try:
        assert srv.wait(40) == 2
        out = srv.output()
        assert f"a GPU worker did not become READY on {addr} within 2 s (none connected)" in out
        assert f"ft worker gpu --engine-addr {addr}" in out
    finally:
        srv.kill()


def test_a_killed_runs_expert_store_is_reclaimed_by_the_next_start(tmp_path, reference):
    from ftexpert.proto.shm_segment import _read_header_of_file, shm_path

    store = f"ft-test-stale-{os.getpid()}"
    args = ["--moe-strategy", "offload", "--store-name", store, *TINY_ARGS]
    first = Server(args, tmp_path / "first.log", grpc=False)
    second = None
    try:
        first.wait_listening()
        (worker_pid,) = children_pids(first.pid, "worker gpu")
        header = _read_header_of_file(shm_path(store))
        assert header is not None and header.creator_pid == first.pid
        first.popen.kill()                                    # kill -9 the coordinator: nothing unlinks
        first.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(worker_pid), "the GPU worker outlived its coordinator"
        assert os.path.exists(shm_path(store))                # the stale segment
        second = Server(args, tmp_path / "second.log", grpc=False).wait_listening()
        out = second.output()                                 # reclaimed at start-up, named, with its bytes
        assert "reclaimed 1 stale shared-memory segment" in out and f"{store} (" in out \
            and f"bytes, creator pid {first.pid})" in out, out[-2000:]
        body = second.complete(PROMPTS[0], 24)                # offload through the store == resident
        assert body["choices"][0]["text"] == reference["completions"][PROMPTS[0]][0]
        assert second.stop() == 0
        assert not os.path.exists(shm_path(store))            # unlinked by its creator at shutdown
    finally:
        first.kill()
        if second is not None:
            second.kill()
        if os.path.exists(shm_path(store)):
            os.unlink(shm_path(store))


def _metric(srv: Server, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _expect_cpu_shares_resume(srv: Server, prompt: str, want: str, timeout_s: float = 60.0) -> None:
    """The restarted CPU worker is re-admitted by the GPU worker: CPU shares resume, answers unchanged."""
    before = _metric(srv, "ft_experts_cpu_total")
    deadline = time.monotonic() + timeout_s
    while _metric(srv, "ft_experts_cpu_total") <= before and time.monotonic() < deadline:
        assert srv.complete(prompt, 24)["choices"][0]["text"] == want
    if _metric(srv, "ft_experts_cpu_total") <= before:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("GET", "/metrics")
        stats = [line for line in conn.getresponse().read().decode().splitlines()
                 if any(k in line for k in ("readmi", "fallback", "decode_step", "mode", "degraded", "failures"))]
        conn.close()
        raise AssertionError("CPU shares did not resume after the restart; engine stats:\n" + "\n".join(stats)
                             + "\noutput:\n" + srv.output()[-8000:])


def _wait_metric_above(srv: Server, name: str, floor: float, timeout_s: float = 10.0) -> float:
    """The metric once it passes `floor` (the GPU worker's stats reach the coordinator after the steps that
    made them: a fast machine can answer before they arrive), or its last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    value = _metric(srv, name)
    while value <= floor and time.monotonic() < deadline:
        time.sleep(0.05)
        value = _metric(srv, name)
    return value


def test_hybrid_process_set_supervises_cpu_workers_and_survives_losing_one(tmp_path, reference):
    """The GPU worker on --device cpu hands the CPU share over on the host (the device hand-off is the GPU's:
    test_hybrid_device_handoff_under_ft_serve_on_the_gpu)."""
    store = f"ft-test-hybrid-{os.getpid()}"
    srv = Server(["--moe-strategy", "hybrid", "--num-cpu-workers", "1", "--store-name", store, *TINY_ARGS],
                 tmp_path / "serve.log")
    try:
        srv.wait_listening()
        assert os.path.exists(f"/dev/shm/{store}") and os.path.exists(f"/dev/shm/{store}.cpu0")   # coordinator's
        (cpu_pid,) = children_pids(srv.pid, "worker cpu")
        body = srv.complete(PROMPTS[0], 24)
        assert body["choices"][0]["text"] == reference["completions"][PROMPTS[0]][0]
        assert _wait_metric_above(srv, "ft_experts_cpu_total", 0) > 0      # misses went to the CPU worker
        os.kill(cpu_pid, signal.SIGKILL)                           # the GPU worker fetches its share instead
        body = srv.complete(PROMPTS[1], 24)
        assert body["choices"][0]["text"] == reference["completions"][PROMPTS[1]][0]
        deadline = time.monotonic() + 60
        while children_pids(srv.pid, "worker cpu") in ([], [cpu_pid]) and time.monotonic() < deadline:
            time.sleep(0.1)
        (new_pid,) = children_pids(srv.pid, "worker cpu")          # restarted by the coordinator's supervisor
        assert new_pid != cpu_pid
        _expect_cpu_shares_resume(srv, PROMPTS[2], reference["completions"][PROMPTS[2]][0])
        assert srv.stop() == 0
        assert not any(n.startswith(store) for n in os.listdir("/dev/shm"))
    finally:
        srv.kill()


@pytest.mark.gpu
def test_hybrid_device_handoff_under_ft_serve_on_the_gpu(tmp_path):
    """The whole process set on a GPU: the GPU worker decodes in CUDA graphs with the ring/join kernels
    (the hand-off of decode steps on a GPU), the coordinator supervises one CPU
    worker. Greedy answers equal a resident `ft serve` on the same GPU, before and after the CPU worker is
    SIGKILLed mid-service (the failed step is re-run as offload, the worker restarted and re-admitted)."""
    gpu_args = [a if a != "cpu" else "cuda" for a in TINY_ARGS]      # --preset tiny --device cuda ...
    resident = Server(["--moe-strategy", "resident", *gpu_args], tmp_path / "resident.log")
    try:
        resident.wait_listening(180)
        want = [resident.complete(p, 24)["choices"][0]["text"] for p in PROMPTS]
        assert resident.stop() == 0
    finally:
        resident.kill()
    store = f"ft-test-hybrid-gpu-{os.getpid()}"
    srv = Server(["--moe-strategy", "hybrid", "--num-cpu-workers", "1", "--store-name", store, *gpu_args],
                 tmp_path / "serve.log")
    try:
        srv.wait_listening(180)
        assert "CPU share hand-off: device" in srv.output()
        (cpu_pid,) = children_pids(srv.pid, "worker cpu")
        assert srv.complete(PROMPTS[0], 24)["choices"][0]["text"] == want[0]
        assert _metric(srv, "ft_experts_cpu_total") > 0
        os.kill(cpu_pid, signal.SIGKILL)
        assert srv.complete(PROMPTS[1], 24)["choices"][0]["text"] == want[1]
        deadline = time.monotonic() + 60
        while children_pids(srv.pid, "worker cpu") in ([], [cpu_pid]) and time.monotonic() < deadline:
            time.sleep(0.1)
        (new_pid,) = children_pids(srv.pid, "worker cpu")
        assert new_pid != cpu_pid
        _expect_cpu_shares_resume(srv, PROMPTS[2], want[2])
        assert srv.stop() == 0
    finally:
        srv.kill()
