"""bench/prefetch_served.py: `ft serve` with the lookahead prefetch off and on (real processes, the embedded default
model, offload at 8 of 32 slots, CPU) answers cold prompts through the openai client identically, with useful
predictions on the `on` side; and the comparison fails when the answers differ."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def served():
    spec = importlib.util.spec_from_file_location("prefetch_served", os.path.join(REPO, "bench", "prefetch_served.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefetch_on_serves_the_answers_of_prefetch_off(served, tmp_path):
    out = tmp_path / "result.json"
    code = served.main(["--prompts", "8", "--max-tokens", "48", "--concurrency", "2", "--log-dir", str(tmp_path),
                        "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["mismatches"] == 0 and result["prompts"] == 8, result
    assert result["on_prefetch"]["prefetch_useful_total"] > 0
    assert result["on_misses"] < result["off_misses"]                 # the prefetch turned misses into hits
    assert (tmp_path / "serve-off.log").is_file() and (tmp_path / "serve-on.log").is_file()


def test_a_differing_answer_is_a_failure(served, tmp_path, monkeypatch, capsys):
    answers = {"off": [("a b", "length"), ("c d", "length")], "on": [("a b", "length"), ("c e", "length")]}
    counters = {"prefetch_useful_total": 3.0, "expert_misses_total": 5.0}
    monkeypatch.setattr(served, "run_side", lambda mode, *_: (answers[mode], counters, 0.1))
    monkeypatch.setattr(served, "cold_prompts", lambda count, words: ["p0", "p1"])
    assert served.main(["--prompts", "2", "--log-dir", str(tmp_path)]) == 1
    assert "mismatch on prompt 1" in capsys.readouterr().out
    answers["on"] = answers["off"]
    assert served.main(["--prompts", "2", "--log-dir", str(tmp_path)]) == 0
    counters["prefetch_useful_total"] = 0.0                          # identical, but the prefetch never helped
    assert served.main(["--prompts", "2", "--log-dir", str(tmp_path)]) == 1


def test_cold_prompts_have_distinct_prefixes(served):
    prompts = served.cold_prompts(60, 24)
    assert len(prompts) == 60 and all(len(p.split()) == 24 for p in prompts)
    assert len({" ".join(p.split()[:4]) for p in prompts}) == 60
