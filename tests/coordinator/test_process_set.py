"""ProcessSet's plan without starting anything: the children `ft serve --workers process` would start
(the cpu/hybrid strategies add `ft worker cpu` per worker), each argv accepted by ft's own parser, and
the GPU worker's flags giving exactly the coordinator's engine config (so its HELLO is accepted)."""
from __future__ import annotations

import os

import pytest

from ftexpert.coordinator.cli import build_parser
from ftexpert.coordinator.process_set import ProcessSet, default_store_name, options_from_serve_args
from ftexpert.gpu_worker.api import open_model_source
from ftexpert.gpu_worker.worker_main import GpuWorkerOptions
from ftexpert.proto import engine_messages as em


def worker_config(argv: list[str]) -> dict:
    a = build_parser().parse_args(argv)
    return GpuWorkerOptions(engine_addr=a.engine_addr, model=a.model, preset=a.preset, device=a.device,
                            moe_strategy=a.moe_strategy, moe_cache_size=a.moe_cache_size,
                            max_running_requests=a.max_running_requests, max_context_tokens=a.max_context_tokens,
                            num_cpu_workers=a.num_cpu_workers).engine_config()


@pytest.mark.parametrize("strategy,cpu_workers", [("resident", 0), ("offload", 0), ("hybrid", 2), ("cpu", 1)])
def test_worker_specs_match_the_coordinators_config(strategy, cpu_workers, tmp_path):
    from ftexpert.coordinator.engine_link import EngineLinkServer

    serve = build_parser().parse_args(["serve", "--model", str(tmp_path / "m"), "--moe-strategy", strategy,
                                       "--moe-cache-size", "16", "--max-context-tokens", "1024", "--port", "2345",
                                       "--num-cpu-workers", str(cpu_workers)])
    options = options_from_serve_args(serve)
    assert options.store_name == default_store_name(2345) == "ft-experts-2345"
    options.store_name = store = f"ft-test-ps-{os.getpid()}"                # the resources are made for real
    procs = ProcessSet(options, open_model_source(None, None, device="cpu"))
    res = procs.create_resources()
    procs.link = EngineLinkServer("tcp://127.0.0.1:0", options.config)      # bound, not started
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
    assert gpu.config_hash == em.engine_config_hash(options.config)
    assert worker_config(gpu.argv[3:]) == options.config                    # HELLO's hash will match
    assert "--parent-pid" in gpu.argv and str(os.getpid()) in gpu.argv
    for i, spec in enumerate(specs[:-1]):
        args = build_parser().parse_args(spec.argv[3:])
        assert (args.store, args.channel, args.worker_index, args.num_workers) == (store, f"{store}.cpu{i}", i,
                                                                                   cpu_workers)
        assert spec.config_hash == store_hash != ""                         # the store's hash, as the worker sends
    assert options.config["num_cpu_workers"] == cpu_workers


def test_serve_attach_names_the_worker_flags_that_do_not_reach_an_attached_worker():
    """--attach: the GPU worker runs with its own flags; the local ones given to ft serve are named in a warning."""
    from ftexpert.coordinator.cli import build_parser
    from ftexpert.coordinator.process_set import flags_an_attached_worker_ignores

    parser = build_parser()
    given = ["--moe-slot-audit", "4", "--overlap-decode", "off"]
    attached = parser.parse_args(["serve", "--attach", *given])
    assert flags_an_attached_worker_ignores(attached) == ["--moe-slot-audit", "--overlap-decode"]
    assert flags_an_attached_worker_ignores(parser.parse_args(["serve", "--attach", "--pdl", "off"])) == ["--pdl"]
    chunk = parser.parse_args(["serve", "--attach", "--prefill-chunk-tokens", "1024"])
    assert flags_an_attached_worker_ignores(chunk) == ["--prefill-chunk-tokens"]
    assert flags_an_attached_worker_ignores(parser.parse_args(["serve", "--attach"])) == []
    assert flags_an_attached_worker_ignores(parser.parse_args(["serve", *given])) == []     # started here: they apply


def test_serve_passes_the_prefill_chunk_and_the_overlap_to_its_gpu_worker(tmp_path):
    """`ft serve --prefill-chunk-tokens N --overlap-decode off` (process mode): the GPU worker's argv carries both,
    its own parser takes them, and they stay out of the hashed engine config (local to the worker)."""
    serve = build_parser().parse_args(["serve", "--model", str(tmp_path / "m"), "--moe-strategy", "offload",
                                       "--prefill-chunk-tokens", "1024", "--overlap-decode", "off"])
    options = options_from_serve_args(serve)
    flags = options.engine_flags
    assert flags[flags.index("--prefill-chunk-tokens") + 1] == "1024"
    assert flags[flags.index("--overlap-decode") + 1] == "off"
    worker = build_parser().parse_args(["worker", "gpu", "--engine-addr", "tcp://127.0.0.1:1", *flags])
    assert (worker.prefill_chunk_tokens, worker.overlap_decode) == (1024, "off")
    assert "prefill_chunk_tokens" not in options.config and "overlap_decode" not in options.config
    plain = options_from_serve_args(build_parser().parse_args(["serve", "--model", str(tmp_path / "m")]))
    assert "--prefill-chunk-tokens" not in plain.engine_flags             # unset: the worker's default applies


def test_inline_serve_builds_engines_with_the_given_prefill_chunk():
    """`ft serve --workers inline --prefill-chunk-tokens N`: load_served_engine hands N to every engine it makes."""
    from ftexpert.coordinator.engine_factory import load_served_engine

    served = load_served_engine(None, None, "cpu", max_running_requests=1, max_context_tokens=256,
                                prefill_chunk_tokens=96)
    assert served.engine_factory().prefill_chunk_tokens == 96
    assert served.engine_factory().prefill_chunk_tokens == 96                  # the probe, then a fresh one


@pytest.mark.parametrize("argv", [["serve"], ["generate", "--prompt-ids", "1"], ["worker", "gpu", "--engine-addr", "x"]])
@pytest.mark.parametrize("bad", ["0", "-5", "many"])
def test_a_bad_prefill_chunk_is_refused_when_the_flags_are_parsed(argv, bad, capsys):
    """--prefill-chunk-tokens below 1 (or not a number) stops ft generate, ft serve and ft worker gpu while their
    flags are parsed, naming the flag: before a model loads or an expert store is filled."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--prefill-chunk-tokens", bad])
    assert exc.value.code == 2
    assert "--prefill-chunk-tokens" in capsys.readouterr().err
