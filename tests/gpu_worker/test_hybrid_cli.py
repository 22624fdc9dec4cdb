"""Wiring of the cpu / hybrid strategies: `ft generate` flags and knobs, `ft bench bw`, the profile."""
from __future__ import annotations

import json
import logging

import pytest

from ftexpert.coordinator.cli import main
from ftexpert.proto.bandwidth_profile import ExpertFormat, load_bandwidth_profile

BASE = ["generate", "--preset", "tiny", "--prompt-ids", "5,17,42,99,3", "--max-new-tokens", "10", "--ignore-eos", "--device", "cpu",
        "--json", "--moe-cache-size", "10"]


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FREETOKEN_BENCHBW_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))     # no profile at the default location


def generate(capsys, *extra: str) -> dict:
    assert main(BASE + list(extra)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def resident_tokens(capsys):
    return generate(capsys)["token_ids"]


def test_bench_bw_writes_a_profile_entry_and_keeps_other_hardware(tmp_path, capsys):
    path = tmp_path / "bw.json"
    other = {"gpu_name": "NVIDIA H200", "dtype": "bfloat16", "hidden_size": 2048, "intermediate_size": 768,
             "pcie_gb_s": 54.6, "cpu_gb_s": 26.0}
    path.write_text(json.dumps({"gpu_name": "NVIDIA H200", "entries": [other]}))
    argv = ["bench", "bw", "--preset", "tiny", "--device", "cpu", "--store-mib", "2", "--calls", "20",
            "--cpu-threads", "1", "--out", str(path), "--json"]
    assert main(argv) == 0
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (entry["gpu_name"], entry["dtype"], entry["hidden_size"], entry["intermediate_size"]) == \
        ("cpu", "float32", 64, 64)
    assert entry["pcie_gb_s"] > 0 and entry["cpu_gb_s"] > 0 and entry["copy_kind"] == "host memcpy (no CUDA)"
    assert entry["fetch_fraction"] == pytest.approx(entry["pcie_gb_s"] / (entry["pcie_gb_s"] + entry["cpu_gb_s"]),
                                                    abs=1e-3)                 # from the separate figures
    assert entry["pcie_shared_gb_s"] > 0 and entry["cpu_shared_gb_s"] > 0 and entry["shared_gb_s"] > 0
    assert json.loads(path.read_text())["entries"][-1] == entry
    # the policy's reader takes the entry, extra keys and all, with the separate figures
    profile = load_bandwidth_profile(str(path), ExpertFormat("float32", 64, 64), "cpu")
    assert profile is not None and (profile.pcie_gb_s, profile.cpu_gb_s) == (entry["pcie_gb_s"], entry["cpu_gb_s"])
    assert main(argv + ["--no-shared"]) == 0                    # same key again: replaced, not appended
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not {"pcie_shared_gb_s", "cpu_shared_gb_s", "shared_gb_s"} & entry.keys()
    doc = json.loads(path.read_text())
    assert len(doc["entries"]) == 2 and doc["entries"][0] == other and doc["entries"][1] == entry


def test_hybrid_fetch_fraction_comes_from_a_matching_profile(tmp_path, monkeypatch, capsys, resident_tokens):
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"gpu_name": "cpu", "entries": [
        {"dtype": "float32", "hidden_size": 64, "intermediate_size": 64, "pcie_gb_s": 30.0, "cpu_gb_s": 10.0}]}))
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(path))
    out = generate(capsys, "--moe-strategy", "hybrid")
    assert out["token_ids"] == resident_tokens
    assert out["experts"]["fetch_fraction_source"] == f"profile:{path}"
    assert out["experts"]["policy"]["fetch_fraction"] == pytest.approx(0.75)
    assert out["experts"]["experts_fetched_total"] > 0 and out["experts"]["cpu_triples_total"] > 0
    # a given fraction wins over the profile
    out = generate(capsys, "--moe-strategy", "hybrid", "--fetch-fraction", "0.2")
    assert out["experts"]["fetch_fraction_source"] == "flag" and out["experts"]["policy"]["fetch_fraction"] == 0.2


def test_a_profile_of_other_hardware_is_ignored_with_a_log_line(tmp_path, monkeypatch, capsys, caplog):
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"gpu_name": "NVIDIA H200", "entries": [
        {"dtype": "float32", "hidden_size": 64, "intermediate_size": 64, "pcie_gb_s": 30.0, "cpu_gb_s": 10.0}]}))
    caplog.set_level(logging.INFO)
    out = generate(capsys, "--moe-strategy", "hybrid", "--benchbw-path", str(path))
    assert out["experts"]["fetch_fraction_source"] == "default" and out["experts"]["policy"]["fetch_fraction"] == 0.5
    assert any("ignoring bandwidth profile" in r.getMessage() and "NVIDIA H200" in r.getMessage()
               for r in caplog.records)


def test_knobs_from_the_environment_and_flags(monkeypatch, capsys, resident_tokens):
    monkeypatch.setenv("FREETOKEN_HYBRID_FETCH_ROUND", "prefer-fetch")
    out = generate(capsys, "--moe-strategy", "hybrid", "--fetch-fraction", "0.5", "--no-promote")
    policy = out["experts"]["policy"]
    assert (policy["fetch_round"], policy["promote"]) == ("prefer-fetch", False)
    assert out["token_ids"] == resident_tokens
    out = generate(capsys, "--moe-strategy", "hybrid", "--fetch-round", "stochastic")     # flag > environment
    assert out["experts"]["policy"]["fetch_round"] == "stochastic"


def test_cpu_strategy_from_the_command_line(capsys, resident_tokens):
    out = generate(capsys, "--moe-strategy", "cpu", "--num-cpu-workers", "2")
    assert out["token_ids"] == resident_tokens and out["moe_strategy"] == "cpu"
    ex = out["experts"]
    assert ex["experts_fetched_total"] == 0 and ex["cpu_triples_total"] == ex["routed_pairs"] > 0
    assert set(ex["cpu_workers"]) == {"cpu0", "cpu1"} and ex["fetch_fraction_source"] == "strategy cpu"


@pytest.mark.parametrize("flags, message", [
    (["--fetch-fraction", "1.5"], "must be within"), (["--num-cpu-workers", "-1"], "must be >= 0"),
])
def test_bad_hybrid_flags_say_what_to_do(capsys, flags, message):
    try:
        code = main(BASE + ["--moe-strategy", "hybrid", *flags])
    except SystemExit as exc:             # refused by the flag's type, as it is parsed
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_host_handoff_without_a_gpu(capsys, resident_tokens):
    """On a CPU device the CPU share takes the host hand-off (the device kernels are for a CUDA GPU:
    tests/coordinator/test_serve_processes.py checks those on the GPU machine), the interpreter notwithstanding."""
    out = generate(capsys, "--moe-strategy", "hybrid", "--fetch-fraction", "0.5")
    assert out["token_ids"] == resident_tokens
    ex = out["experts"]
    assert ex["cpu_triples_total"] > 0 and ex["handoff_s_total"] > 0 and "handoff" not in ex


@pytest.mark.parametrize("flag", [["--hybrid-handoff", "device"], ["--fetch-select", "recency"]])
def test_retired_flags_are_refused(capsys, flag):
    """--hybrid-handoff (the hand-off follows the device) and --fetch-select (always recency) are gone."""
    with pytest.raises(SystemExit):
        main(BASE + ["--moe-strategy", "hybrid", *flag])
    assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
    import argparse

    from ftexpert.gpu_worker.worker_cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(flag)
