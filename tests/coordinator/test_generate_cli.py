"""`ft generate`: one completion in one process, plain and --json, and its errors."""
from __future__ import annotations

import json

import pytest

from ftexpert.coordinator.cli import main
from tests.gpu_worker.test_models_util import hf_greedy, hf_model, prompt_ids, save_hf


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def last_json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_json_output_with_the_embedded_default_model(capsys):
    assert main(["generate", "--prompt", "The quick brown", "--max-new-tokens", "6", "--ignore-eos",
                 "--device", "cpu", "--json"]) == 0
    result = last_json(capsys)
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
    assert isinstance(result["text"], str) and result["text"]
    assert "default-moe" in result["model"] and result["device"] == "cpu"
    timing = result["timing"]
    assert timing["ttft_s"] > 0 and timing["decode_s"] > 0 and timing["load_s"] >= 0
    assert timing["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_host_strategies_give_the_resident_tokens_over_the_owners_resources(capsys, strategy):
    """offload / hybrid: the store (and the CPU worker, its channel, its supervisor) come from the coordinator's
    ExpertResources; the tokens equal resident's, and nothing is left in /dev/shm afterwards."""
    import os

    argv = ["generate", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "5", "--ignore-eos", "--device", "cpu", "--json"]
    assert main(argv) == 0
    resident = last_json(capsys)["token_ids"]
    extra = ["--num-cpu-workers", "1", "--cpu-threads", "1", "--fetch-fraction", "0.5"] if strategy == "hybrid" else []
    assert main([*argv, "--moe-strategy", strategy, "--moe-cache-size", "0.25", *extra]) == 0
    result = last_json(capsys)
    assert result["token_ids"] == resident and result["moe_strategy"] == strategy
    if strategy == "hybrid":
        assert result["experts"]["fetch_fraction_source"] == "flag"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ft-generate-{os.getpid()}")]


def test_greedy_ids_match_transformers_through_the_cli(capsys, tmp_path):
    hf = hf_model("olmoe", seed=4)
    model_dir = save_hf(hf, tmp_path / "olmoe")
    prompt = prompt_ids(7, seed=9)
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "10", "--json", "--device", "cpu"]) == 0
    result = last_json(capsys)
    assert result["token_ids"] == hf_greedy(hf, prompt, 10) and result["prompt_token_ids"] == prompt
    assert result["text"] == ""                     # no tokenizer.json in this checkpoint


def test_sampling_seed_is_reproducible(capsys):
    args = ["generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--temperature", "1.0",
            "--top-p", "0.9", "--top-k", "40", "--ignore-eos", "--device", "cpu", "--json"]
    runs = []
    for seed in ("1", "1", "2"):
        assert main(args + ["--seed", seed]) == 0
        runs.append(last_json(capsys)["token_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_plain_output_streams_text(capsys):
    assert main(["generate", "--prompt", "Hello", "--chat", "--max-new-tokens", "5", "--device", "cpu",
                 "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "5 tokens" in captured.err


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", "1,2", "--moe-strategy", "offload", "--moe-cache-size", "5"], "at least 8 slots"),
    (["--prompt-ids", "1,2", "--model", "/nonexistent/model"], "config.json not found"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1,2", "--chat"], "--chat needs --prompt"),
])
def test_errors_exit_2_with_the_fix(capsys, argv, message):
    assert main(["generate", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_prompt_text_needs_a_tokenizer(capsys, tmp_path):
    model_dir = save_hf(hf_model("mixtral"), tmp_path / "m")
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_help_lists_generate(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--preset", "--prompt-ids", "--moe-strategy", "--moe-cache-size", "--json", "--device"):
        assert flag in out


def test_cli_preset_choices_match_the_registry():
    """The engine flags repeat the names (parsing them must not import torch); keep them in step."""
    from ftexpert.gpu_worker.checkpoint import presets
    from ftexpert.proto import engine_spec
    assert tuple(engine_spec.PRESET_NAMES) == tuple(presets.PRESET_NAMES)


def test_moe_prefetch_flags_reach_the_backend_and_keep_the_tokens(capsys, monkeypatch):
    """--moe-prefetch on (offload): the resident tokens, and the backend counted its installs; the knob alone
    (FREETOKEN_MOE_PREFETCH) does the same; resident refuses it with the fix; auto keeps the tokens, and off is the default."""
    argv = ["generate", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu", "--json"]
    assert main(argv) == 0
    resident = last_json(capsys)["token_ids"]
    assert main([*argv, "--moe-strategy", "offload", "--moe-cache-size", "8", "--moe-prefetch", "on",
                 "--moe-prefetch-budget", "2"]) == 0
    result = last_json(capsys)
    assert result["token_ids"] == resident
    assert result["experts"]["prefetch_installed_total"] > 0
    monkeypatch.setenv("FREETOKEN_MOE_PREFETCH", "measure")
    assert main([*argv, "--moe-strategy", "offload", "--moe-cache-size", "8"]) == 0
    result = last_json(capsys)
    assert result["token_ids"] == resident
    assert result["experts"]["prefetch_predicted_total"] > 0 and result["experts"]["prefetch_installed_total"] == 0
    assert main(argv) == 2
    assert "needs a slot cache" in capsys.readouterr().err
    monkeypatch.delenv("FREETOKEN_MOE_PREFETCH")
    assert main([*argv, "--moe-strategy", "offload", "--moe-cache-size", "8"]) == 0     # the default: off
    result = last_json(capsys)
    assert result["token_ids"] == resident and result["experts"]["prefetch_layer_calls_total"] == 0
    assert main([*argv, "--moe-strategy", "offload", "--moe-cache-size", "8", "--moe-prefetch", "auto"]) == 0
    result = last_json(capsys)
    assert result["token_ids"] == resident
    # a CPU measures no idle link time: auto installs nothing, and does not even predict
    assert result["experts"]["prefetch_installed_total"] == result["experts"]["prefetch_predicted_total"] == 0
    assert main(argv) == 0, "resident takes the default auto as nothing"


def test_building_ft_s_parser_imports_no_torch():
    """`ft --help`, `ft ctl ...` and every command's start build the whole parser: no subcommand module may import
    torch (or triton) while declaring its flags; the heavy imports come when a command runs."""
    import subprocess
    import sys

    code = ("import sys; from ftexpert.coordinator.cli import build_parser; build_parser(); "
            "heavy = sorted(m for m in ('torch', 'triton') if m in sys.modules); print(heavy); sys.exit(bool(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"building the parser imported {proc.stdout.strip()}{proc.stderr[-2000:]}"


def test_the_slot_cache_packages_names_are_its_functions_whatever_was_imported_first():
    """The slot-cache package loads its names on first use: each is the function or class, never a submodule of
    the same name, whichever module was imported before."""
    import subprocess
    import sys

    code = ("import inspect, ftexpert.kernels.slot_cache.audit, ftexpert.kernels.slot_cache.api as api; "
            "import ftexpert.kernels.slot_cache as sc; "
            "bad = [n for n in sc.__all__ if inspect.ismodule(getattr(sc, n))]; print(bad); sys.exit(bool(bad))")
    proc = subprocess.run([sys.executable, "-c", "import sys; " + code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
