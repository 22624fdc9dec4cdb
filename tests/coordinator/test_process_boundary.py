"""The process boundary of `ft serve --workers process`: the coordinator imports neither torch nor any module of the
GPU worker (or the kernels); `ft worker store`, a short-lived child, opens the model for it and fills the expert
store the coordinator created and owns. A child that fails gives a clear error and leaves nothing in /dev/shm.

How the coordinator's modules are seen: `ft serve` runs as usual, but from a two-line `python -c` wrapper that
calls ft's `main` and, at the interpreter's exit (after SIGTERM's drain, once everything has run: start-up,
requests, shutdown), writes `sorted(sys.modules)` to a file. Nothing in the product serves that list, and every
module the coordinator imported in its whole life is in it, not just those of one moment.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from serve_support import Server, children_pids  # noqa: E402

from ftexpert.proto.shm_segment import shm_path  # noqa: E402

MODULES_AT_EXIT = textwrap.dedent("""
    import atexit, json, sys
    atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules))))
    from ftexpert.coordinator.cli import main
    sys.exit(main(sys.argv[2:]))
""")
CPU_ARGS = ["--device", "cpu", "--max-context-tokens", "512", "--max-running-requests", "4"]
FORBIDDEN = ("torch", "triton", "ftexpert.gpu_worker", "ftexpert.kernels")


def forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def shm_leftovers(store: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(store)]


@pytest.mark.parametrize("strategy", ["resident", "offload"])
def test_the_coordinator_imports_no_torch_and_no_model_code(tmp_path, strategy):
    """On the embedded default model (no --model, no --preset): the coordinator serves completions; for offload
    the store it created (its pid in the header) was filled by `ft worker store`, which has exited."""
    from ftexpert.proto.shm_segment import _read_header_of_file

    modules_file = tmp_path / "modules.json"
    store = f"ft-test-boundary-{os.getpid()}-{strategy}"
    srv = Server(["--moe-strategy", strategy, "--store-name", store, *CPU_ARGS], tmp_path / "serve.log", grpc=False,
                 command=[sys.executable, "-c", MODULES_AT_EXIT, str(modules_file)], default_model=True)
    try:
        srv.wait_listening()
        body = srv.complete("Once upon a time", 12)
        assert body["usage"]["completion_tokens"] == 12
        assert "default-moe" in srv.output()                           # the embedded default model
        assert children_pids(srv.pid, "worker store") == []             # the filler is gone once it is done
        if strategy == "offload":
            header = _read_header_of_file(shm_path(store))
            assert header is not None and header.creator_pid == srv.pid  # the coordinator owns the store
            assert "[store pid" in srv.output() and f"expert store '{store}' filled" in srv.output()
        assert srv.stop() == 0, srv.output()[-3000:]
    finally:
        srv.kill()
    modules = json.loads(modules_file.read_text())
    assert "ftexpert.coordinator.serve_cli" in modules and "ftexpert.coordinator.process_set" in modules
    assert forbidden(modules) == [], forbidden(modules)
    assert shm_leftovers(store) == []                                   # unlinked by its owner at stop


def broken_checkpoint(directory):
    """The embedded default model with its last layer's experts removed: it opens, and fails while the store fills."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ftexpert.proto.engine_spec import DEFAULT_MODEL_DIR

    shutil.copytree(DEFAULT_MODEL_DIR, directory)
    weights = load_file(str(directory / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.3.mlp.experts.")},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("workers", ["process", "attach"])
def test_a_failing_store_filler_is_a_clear_error_and_leaves_no_segment(tmp_path, workers):
    model = broken_checkpoint(tmp_path / "broken")
    store = f"ft-test-boundary-fail-{os.getpid()}"
    mode = ["--attach", "--worker-ready-timeout-s", "30"] if workers == "attach" else []
    srv = Server(["--model", str(model), "--moe-strategy", "offload", "--store-name", store, *mode, *CPU_ARGS],
                 tmp_path / "serve.log", grpc=False)
    try:
        assert srv.wait(120) == 2
        out = srv.output()
        assert "ft: error: `ft worker store` (pid " in out, out[-3000:]
        assert f"could not fill the expert store '{store}': layer 3's experts are missing from {model}" in out
        assert "Traceback" not in out                                # a message that says what to do, not a trace
    finally:
        srv.kill()
    assert shm_leftovers(store) == []


def test_a_model_that_does_not_open_fails_before_any_segment(tmp_path):
    store = f"ft-test-boundary-none-{os.getpid()}"
    srv = Server(["--model", str(tmp_path / "nothing-here"), "--moe-strategy", "offload", "--store-name", store,
                  *CPU_ARGS], tmp_path / "serve.log", grpc=False)
    try:
        assert srv.wait(120) == 2
        out = srv.output()
        assert "ft: error: `ft worker store` (pid " in out and "could not open the model: " in out, out[-3000:]
        assert str(tmp_path / "nothing-here") in out
    finally:
        srv.kill()
    assert shm_leftovers(store) == []


# -- the parent's end alone, against children that misbehave -------------------------------------------------

FAKE_CHILD = textwrap.dedent("""
    import os, signal, sys
    from multiprocessing.connection import Connection
    from ftexpert.proto import model_facts as mf
    fd = int(sys.argv[sys.argv.index("--link-fd") + 1])
    conn = Connection(fd)
    print("fake store child: started", flush=True)
    if os.environ["FAKE_CHILD"] == "exit":
        print("fake store child: giving up", flush=True)
        sys.exit(3)
    request = mf.decode(conn.recv_bytes())
    conn.send_bytes(mf.encode(mf.ModelFacts(
        description="fake", vocab_size=32, hidden_size=64, top_k=2, num_layers=2, num_experts=4,
        expert_intermediate_size=32, dtype="float32", expert_format="bf16", expert_act="silu", config_hash="fake",
        eos_token_ids=(1,), tokenizer_dir="")))
    mf.decode(conn.recv_bytes())                      # FillStore: the store exists now
    print("fake store child: killed mid-fill", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.fixture
def fake_child(monkeypatch):
    from ftexpert.coordinator import model_child

    monkeypatch.setattr(model_child, "FT_COMMAND", (sys.executable, "-c", FAKE_CHILD))

    def behave(how: str) -> None:
        monkeypatch.setenv("FAKE_CHILD", how)
    return behave


def test_a_child_killed_mid_fill_leaves_no_store(fake_child, capfd):
    from ftexpert.coordinator.expert_resources import ExpertResources
    from ftexpert.coordinator.model_child import ModelChildFailed
    from ftexpert.proto.engine_spec import EngineSpec

    fake_child("killed")
    store = f"ft-test-boundary-killed-{os.getpid()}"
    with pytest.raises(ModelChildFailed) as err:
        ExpertResources.open_in_child(EngineSpec(moe_strategy="offload", device="cpu"), store_name=store,
                                      timeout_s=60)
    message = str(err.value)
    assert f"was killed by SIGKILL before it could fill the expert store '{store}'" in message
    assert "fake store child: killed mid-fill" in message               # the tail of its output, quoted
    assert "fake store child: killed mid-fill" in capfd.readouterr().err  # and forwarded as it came
    assert shm_leftovers(store) == []


def test_a_child_that_exits_without_answering_is_named_with_its_output(fake_child):
    from ftexpert.coordinator.model_child import ModelChild, ModelChildFailed
    from ftexpert.proto.engine_spec import EngineSpec

    fake_child("exit")
    child = ModelChild(EngineSpec(device="cpu"), fill_store=False, timeout_s=60)
    with pytest.raises(ModelChildFailed, match=r"exited with code 3 before it could open the model; its last "
                                               r"output:\n    fake store child: started\n    fake store child: "
                                               r"giving up"):
        child.open()
    child.kill()                                                        # nothing left to stop
    assert child.proc.returncode == 3

