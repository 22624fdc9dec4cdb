"""`ft serve` checks every listen address before it loads anything: a taken port is an error in a second that
names the address, what it is for and the flag that moves it."""
from __future__ import annotations

import socket
import time

import pytest

from ftexpert.coordinator import cli


@pytest.fixture
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def _no_model_load(monkeypatch):
    from ftexpert.gpu_worker import api as gpu_worker_api

    def refuse(*_a, **_k):
        raise AssertionError("the model was opened before the listen addresses were checked")
    monkeypatch.setattr(gpu_worker_api, "open_model_source", refuse)


@pytest.mark.parametrize("what, flags", [
    ("the HTTP API", lambda p: ["--port", str(p), "--grpc-port", "0"]),
    ("the gRPC control plane", lambda p: ["--port", "0", "--grpc-port", str(p)]),
    ("the engine link", lambda p: ["--port", "0", "--grpc-port", "0", "--attach", "--engine-addr",
                                   f"tcp://127.0.0.1:{p}"]),
], ids=["http", "grpc", "engine-link"])
@pytest.mark.parametrize("workers", ["process", "inline"])
def test_a_taken_port_is_refused_before_the_model_loads(taken_port, monkeypatch, capsys, what, flags, workers):
    if what == "the engine link" and workers == "inline":
        pytest.skip("the inline engine has no engine link")
    _no_model_load(monkeypatch)
    start = time.monotonic()
    code = cli.main(["serve", "--device", "cpu", "--workers", workers, *flags(taken_port)])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 5.0
    assert f"cannot listen for {what} on 127.0.0.1:{taken_port}" in err and "Address already in use" in err, err
    assert "ss -ltnp" in err
