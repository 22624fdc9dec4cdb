"""The gRPC control plane and grpc.health.v1 against a live server; `ft ctl` as its client; the
committed descriptor set against the .proto files."""
from __future__ import annotations

import io
import json
import os
import socket
import sys

import grpc
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import FAKE_TEXT, MODEL_NAME, live_server  # noqa: E402
from grpc_support import control_channel  # noqa: E402

from ftexpert.proto import control_rpc as rpc  # noqa: E402


@pytest.fixture(scope="module")
def ls(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("grpc"), real_engine=True) as server:
        yield server


@pytest.fixture
def stubs(ls):
    with control_channel(ls.grpc_address) as channel:
        yield rpc.ControlStub(channel), rpc.HealthStub(channel)


def test_descriptor_set_matches_the_proto_files():
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    from ftexpert.proto.gen_control import compile_descriptor_set
    fresh = descriptor_pb2.FileDescriptorSet.FromString(compile_descriptor_set())
    assert rpc.descriptor_summary(fresh) == rpc.descriptor_summary(), \
        "proto/*.proto changed: run `python -m ftexpert.proto.gen_control` and commit proto/control_descriptors.py"


def test_generate_streams_the_same_text_as_http(ls, stubs):
    import openai
    control, _ = stubs
    request = rpc.msg.GenerateRequest(prompt="Hello there", max_tokens=10,
                                      sampling=rpc.msg.SamplingOptions(temperature=0, ignore_eos=True))
    chunks = list(control.Generate(request, timeout=30))
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10
    assert sum(len(c.token_ids) for c in chunks) == 10
    http = openai.OpenAI(base_url=ls.base_url + "/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.text for c in chunks) == http.choices[0].text


def test_generate_rejects_bad_sampling_with_invalid_argument(stubs):
    control, _ = stubs
    for sampling in (rpc.msg.SamplingOptions(temperature=-1), rpc.msg.SamplingOptions(top_p=0),
                     rpc.msg.SamplingOptions(top_k=-5)):
        with pytest.raises(grpc.RpcError) as info:
            list(control.Generate(rpc.msg.GenerateRequest(prompt="x", sampling=sampling), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        list(control.Generate(rpc.msg.GenerateRequest(prompt=""), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stats_policy_and_workers(ls, stubs):
    control, _ = stubs
    list(control.Generate(rpc.msg.GenerateRequest(prompt="x", max_tokens=3), timeout=30))
    stats = control.GetStats(rpc.msg.GetStatsRequest(), timeout=10)
    assert stats.generated_tokens_total >= 3 and stats.requests_total >= 1
    assert "generated_tokens" in stats.engine            # the real engine's EngineStats, flattened
    policy = control.SetPolicy(rpc.msg.SetPolicyRequest(fetch_fraction=0.4, fetch_round="stochastic"), timeout=10)
    assert policy.fetch_round == "stochastic" and policy.fetch_fraction == pytest.approx(0.4)
    assert not policy.auto_tune and policy.source == "set"
    assert control.GetPolicy(rpc.msg.GetPolicyRequest(), timeout=10).fetch_round == "stochastic"
    with pytest.raises(grpc.RpcError) as info:
        control.SetPolicy(rpc.msg.SetPolicyRequest(fetch_fraction=1.5), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 1]" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        control.SetPolicy(rpc.msg.SetPolicyRequest(fetch_round="nearest"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    workers = control.ListWorkers(rpc.msg.ListWorkersRequest(), timeout=10).workers
    assert [(w.name, w.state) for w in workers] == [("engine", "ready")]


def test_restart_worker_builds_a_fresh_engine(ls, stubs):
    control, _ = stubs
    before = len(ls.engine_box)
    worker = control.RestartWorker(rpc.msg.RestartWorkerRequest(name="engine"), timeout=60).worker
    assert worker.restarts >= 1 and worker.state == "ready" and len(ls.engine_box) == before + 1
    chunks = list(control.Generate(rpc.msg.GenerateRequest(prompt="x", max_tokens=2), timeout=30))
    assert chunks[-1].finished
    with pytest.raises(grpc.RpcError) as info:
        control.RestartWorker(rpc.msg.RestartWorkerRequest(name="gpu7"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "engine" in info.value.details()


def test_health_service_reports_each_component(stubs):
    _, health = stubs
    serving = rpc.SERVING_STATUS.Value("SERVING")
    for name in ("", rpc.CONTROL_SERVICE, "engine", "http", "worker/engine"):
        assert health.Check(rpc.health.HealthCheckRequest(service=name), timeout=10).status == serving, name
    with pytest.raises(grpc.RpcError) as info:
        health.Check(rpc.health.HealthCheckRequest(service="nope"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    statuses = health.List(rpc.health.HealthListRequest(), timeout=10).statuses
    assert statuses["engine"].status == serving
    watch = health.Watch(rpc.health.HealthCheckRequest(service="engine"), timeout=10)
    assert next(watch).status == serving
    watch.cancel()


def test_drain_and_resume_over_grpc(ls, stubs):
    control, health = stubs
    reply = control.Drain(rpc.msg.DrainRequest(timeout_s=1), timeout=10)
    assert reply.draining and reply.requests_aborted == 0
    with pytest.raises(grpc.RpcError) as info:
        list(control.Generate(rpc.msg.GenerateRequest(prompt="x"), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health.Check(rpc.health.HealthCheckRequest(service=""), timeout=10).status == \
        rpc.SERVING_STATUS.Value("NOT_SERVING")
    assert not control.Drain(rpc.msg.DrainRequest(resume=True), timeout=10).draining
    assert list(control.Generate(rpc.msg.GenerateRequest(prompt="x", max_tokens=1), timeout=30))[-1].finished


def test_cancelled_generate_aborts_the_engine_request(tmp_path):
    with live_server(tmp_path, engine_kwargs={"step_delay_s": 0.02}) as server:
        with control_channel(server.grpc_address) as channel:
            call = rpc.ControlStub(channel).Generate(rpc.msg.GenerateRequest(prompt="x", max_tokens=200), timeout=30)
            first = next(call)
            assert first.text
            call.cancel()
        server.wait_for(lambda: server.engine.aborted, what="engine.abort after the gRPC client cancelled")
        server.wait_for(lambda: not server.engine.running, what="slots freed")


def test_api_key_guards_control_but_not_health(tmp_path):
    with live_server(tmp_path, api_key="s3cret") as server:
        with grpc.insecure_channel(server.grpc_address) as channel:
            control, health = rpc.ControlStub(channel), rpc.HealthStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                with pytest.raises(grpc.RpcError) as info:
                    control.GetStats(rpc.msg.GetStatsRequest(), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as info:
                    list(control.Generate(rpc.msg.GenerateRequest(prompt="x"), timeout=10, metadata=metadata))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", "Bearer s3cret"),)
            assert control.GetStats(rpc.msg.GetStatsRequest(), timeout=10, metadata=good).uptime_s > 0
            assert health.Check(rpc.health.HealthCheckRequest(service=""), timeout=10).status == \
                rpc.SERVING_STATUS.Value("SERVING")


def ctl(server, *argv, api_key=None) -> tuple[int, str]:
    from ftexpert.coordinator import ctl_cli
    from ftexpert.coordinator.cli import build_parser
    from unittest import mock
    args = build_parser().parse_args(["ctl", "--address", server.grpc_address, "--timeout-s", "20", *argv])
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"FT_API_KEY": api_key or ""}):     # the key never on a command line
        rc = ctl_cli.run(args, out=out)
    return rc, out.getvalue()


def test_ft_ctl_commands(tmp_path, capsys):
    with live_server(tmp_path, api_key="k") as server:
        rc, out = ctl(server, "policy", "set", "--fraction", "0.4", "--round", "prefer-fetch", api_key="k")
        assert rc == 0 and "fetch_fraction: 0.4" in out and "fetch_round: prefer-fetch" in out
        rc, out = ctl(server, "--json", "policy", "get", api_key="k")
        assert rc == 0 and '"fetch_fraction": 0.4' in out
        rc, out = ctl(server, "generate", "--prompt", "hi", "--max-tokens", "5", api_key="k")
        assert rc == 0 and out.strip() == FAKE_TEXT[:5]
        rc, out = ctl(server, "workers", api_key="k")
        assert rc == 0 and "name: engine" in out
        rc, out = ctl(server, "stats", api_key="k")
        assert rc == 0 and "generated_tokens_total: 5" in out
        rc, out = ctl(server, "health")
        assert rc == 0 and "(whole service): SERVING" in out
        rc, _ = ctl(server, "stats")                                # no key
        assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
        rc, out = ctl(server, "shutdown", "--drain-timeout-s", "1", api_key="k")
        assert rc == 0 and "accepted: True" in out
        server.wait_for(lambda: server.server.service.stopped, what="shutdown")
        port = int(server.base_url.rsplit(":", 1)[1])
        server.wait_for(lambda: _closed(port), what="HTTP listener closed")


def _closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_ctl_reports_an_unreachable_server(capsys):
    from ftexpert.coordinator import ctl_cli
    from ftexpert.coordinator.cli import build_parser
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = build_parser().parse_args(["ctl", "--address", f"127.0.0.1:{port}", "--timeout-s", "2", "stats"])
    assert ctl_cli.run(args, out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err     # which one depends on the grpcio version


class _Supervised:
    """A process-mode supervisor's view: a CPU worker and the GPU worker that runs the engine."""

    def __init__(self):
        self.restarted: list[str] = []

    def worker_info(self):
        return [{"name": name, "kind": kind, "state": "ready", "pid": pid, "restarts": self.restarted.count(name),
                 "uptime_s": 1.0, "last_heartbeat_age_s": 0.1, "last_error": ""}
                for name, kind, pid in (("cpu0", "cpu-worker", 101), ("gpu0", "gpu-worker", 102))]

    def restart(self, name: str) -> None:
        self.restarted.append(name)


def test_ft_ctl_workers_lists_each_worker_once(tmp_path):
    supervisor = _Supervised()
    with live_server(tmp_path, api_key="k", supervisor=supervisor, engine_worker="gpu0") as server:
        rc, out = ctl(server, "--json", "workers", api_key="k")
        names = [w["name"] for w in json.loads(out)["workers"]]
        assert rc == 0 and sorted(names) == ["cpu0", "gpu0"], names        # not `engine` as well
        rc, out = ctl(server, "workers", api_key="k")
        assert out.count("name: gpu0") == 1 and "name: engine" not in out
        statuses = server.server.component_health()
        assert "worker/gpu0" in statuses and "worker/engine" not in statuses
        rc, out = ctl(server, "restart", "gpu0", api_key="k")
        assert rc == 0 and supervisor.restarted == ["gpu0"] and "name: gpu0" in out
        rc, out = ctl(server, "restart", "engine", api_key="k")        # the engine's name in every mode
        assert rc == 0 and "name: gpu0" in out
    with live_server(tmp_path, api_key="k") as server:                  # inline: the engine is `engine`
        rc, out = ctl(server, "workers", api_key="k")
        assert rc == 0 and out.count("name: ") == 1 and "name: engine" in out
