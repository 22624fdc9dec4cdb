"""ProcessSet's plan without starting the workers: the children `ft serve --workers process` would start
(the cpu/hybrid strategies add `ft worker cpu` per worker), each argv accepted by ft's own parser; the GPU
worker's argv carries no engine setting (the engine spec travels whole in WELCOME), and the spec it gets is the
one `ft serve` resolved from its flags. The model's facts and the store come from a real `ft worker store`."""
from __future__ import annotations

import os

import pytest

from ftexpert.coordinator.cli import build_parser
from ftexpert.coordinator.process_set import ProcessSet, default_store_name, options_from_serve_args
from ftexpert.gpu_worker.api import build_engine
from ftexpert.proto import engine_messages as em
from ftexpert.proto.engine_spec import EngineSpec, spec_from_args

ENGINE_FLAGS = ("--model", "--preset", "--moe-strategy", "--moe-cache-size", "--max-context-tokens",
                "--max-running-requests", "--num-cpu-workers", "--reserve-cpus", "--prefill-chunk-tokens")


@pytest.mark.parametrize("strategy,cpu_workers", [("resident", 0), ("offload", 0), ("hybrid", 2), ("cpu", 1)])
def test_worker_specs_and_the_spec_the_gpu_worker_gets(strategy, cpu_workers):
    from ftexpert.coordinator.engine_link import EngineLinkServer

    serve = build_parser().parse_args(["serve", "--preset", "tiny", "--moe-strategy", strategy,
                                       "--moe-cache-size", "16", "--max-context-tokens", "1024", "--port", "2345",
                                       "--num-cpu-workers", str(cpu_workers), "--prefill-chunk-tokens", "96",
                                       "--overlap-decode", "off"])
    options = options_from_serve_args(serve, spec_from_args(serve))
    assert options.store_name == default_store_name(2345) == "ft-experts-2345"
    assert options.spec.moe_cache_size == "16" and options.spec.max_context_tokens == 1024
    assert (options.spec.prefill_chunk_tokens, options.spec.overlap) == (96, False)
    assert (options.spec.model, options.spec.preset) == (None, "tiny")
    options.store_name = store = f"ft-test-ps-{os.getpid()}"                # the resources are made for real
    procs = ProcessSet(options)
    model = procs.open_model()                                              # by `ft worker store`
    res = procs.resources
    assert model.vocab_size > 0 and model.tokenizer_dir and res.model is model
    procs.link = EngineLinkServer("tcp://127.0.0.1:0", options.spec)        # bound, not started
    try:
        specs = procs.worker_specs()
        assert res.store_name == (store if strategy != "resident" else "")
        assert res.channel_names == [f"{store}.cpu{i}" for i in range(cpu_workers)]
        store_hash = res.config_hash
    finally:
        procs.link.sock.close(0)
        res.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(store)]   # the owner unlinked what it made
    assert [s.name for s in specs] == [f"cpu{i}" for i in range(cpu_workers)] + ["gpu0"]
    gpu = specs[-1]
    assert gpu.argv[1:3] == ["-m", "ftexpert.coordinator.cli"] and gpu.kind == "gpu-worker"
    assert gpu.config_hash == em.gpu_worker_supervisor_hash()
    assert not [f for f in gpu.argv if f in ENGINE_FLAGS]                   # the spec comes in WELCOME
    worker = build_parser().parse_args(gpu.argv[3:])
    assert worker.parent_pid == os.getpid() and worker.name == "gpu0"
    for i, spec in enumerate(specs[:-1]):
        args = build_parser().parse_args(spec.argv[3:])
        assert (args.store, args.channel, args.worker_index, args.num_workers) == (store, f"{store}.cpu{i}", i,
                                                                                   cpu_workers)
        assert spec.config_hash == store_hash != ""                         # the store's hash, as the worker sends
    assert options.spec.num_cpu_workers == cpu_workers


def test_the_gpu_worker_takes_no_engine_flags(capsys):
    """An engine flag on `ft worker gpu` is refused while the flags are parsed: the worker builds what the
    coordinator's WELCOME says, so a flag there could only be ignored."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["worker", "gpu", "--engine-addr", "x", "--moe-strategy", "offload"])
    assert exc.value.code == 2 and "--moe-strategy" in capsys.readouterr().err


def test_build_engine_takes_the_prefill_chunk_of_the_spec():
    built = build_engine(EngineSpec(device="cpu", max_running_requests=1, max_context_tokens=256,
                                    prefill_chunk_tokens=96))
    try:
        assert built.engine.prefill_chunk_tokens == 96
    finally:
        built.close()


@pytest.mark.parametrize("argv", [["serve"], ["generate", "--prompt-ids", "1"]])
@pytest.mark.parametrize("bad", ["0", "-5", "many"])
def test_a_bad_prefill_chunk_is_refused_when_the_flags_are_parsed(argv, bad, capsys):
    """--prefill-chunk-tokens below 1 (or not a number) stops ft generate and ft serve while their flags are
    parsed, naming the flag: before a model loads or an expert store is filled."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--prefill-chunk-tokens", bad])
    assert exc.value.code == 2
    assert "--prefill-chunk-tokens" in capsys.readouterr().err
