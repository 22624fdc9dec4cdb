"""When a request stops: EOS (unless ignore_eos), stop token ids, max_new_tokens, a full context;
and what add_request refuses."""
from __future__ import annotations

import pytest

from ftexpert.gpu_worker.engine import Engine, EngineConfig, SamplingParams
from ftexpert.gpu_worker.assembly.loader import load_model
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save_hf(hf_model("mixtral", seed=31), tmp_path_factory.mktemp("mixtral")), device="cpu")


def run(model, prompt, params, eos=(), **cfg):
    engine = Engine(model.model, EngineConfig(**{"max_context_tokens": 128, **cfg}), eos_token_ids=eos)
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert all(o.request_id == rid for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return [o.new_token_id for o in outs], outs[-1].finish_reason


@pytest.fixture(scope="module")
def greedy_run(model):
    prompt = prompt_ids(10, seed=2, vocab=model.cfg.vocab_size)
    tokens, reason = run(model, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert reason == "length" and len(tokens) == 20
    return prompt, tokens


def test_eos_stops_unless_ignored(model, greedy_run):
    prompt, full = greedy_run
    eos = full[6]
    first = full.index(eos)
    tokens, reason = run(model, prompt, SamplingParams(max_new_tokens=20), eos=(eos,))
    assert (tokens, reason) == (full[:first + 1], "stop")
    tokens, reason = run(model, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True), eos=(eos,))
    assert (tokens, reason) == (full, "length")


def test_stop_token_ids_stop_even_with_ignore_eos(model, greedy_run):
    prompt, full = greedy_run
    stop = full[9]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop, 10_000))
    tokens, reason = run(model, prompt, params)
    assert (tokens, reason) == (full[:full.index(stop) + 1], "stop")


def test_max_new_tokens(model, greedy_run):
    prompt, full = greedy_run
    assert run(model, prompt, SamplingParams(max_new_tokens=1, ignore_eos=True)) == (full[:1], "length")
    assert run(model, prompt, SamplingParams(max_new_tokens=7, ignore_eos=True)) == (full[:7], "length")


def test_full_context_stops_with_length(model, greedy_run):
    prompt, full = greedy_run                                   # 10 prompt tokens
    tokens, reason = run(model, prompt, SamplingParams(max_new_tokens=50, ignore_eos=True), max_context_tokens=16)
    assert (tokens, reason) == (full[:7], "length")             # positions 0..15 filled, one more token made
    exact = run(model, prompt, SamplingParams(max_new_tokens=50, ignore_eos=True), max_context_tokens=10)
    assert exact == (full[:1], "length")                        # a prompt that fills the context: one token


def test_add_request_validation(model):
    engine = Engine(model.model, EngineConfig(max_context_tokens=16))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="more than max_context_tokens=16"):
        engine.add_request(list(range(17)))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        engine.add_request([1, 128, 2])
    engine.add_request([1, 2], request_id="x")
    engine.add_request([1, 2], request_id=0)
    assert engine.add_request([1, 2]) == 1                 # fresh ids skip ids a caller chose
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3], request_id="x")
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([[1]])
    assert engine.abort("x") and engine.abort(0) and engine.abort(1)
    assert not engine.has_work() and not engine.abort("nope")
