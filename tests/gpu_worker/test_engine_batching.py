"""Continuous batching and chunked prefill: a request's tokens do not depend on who shares its steps,
when it joined, how its prompt was chunked, or which KV row it got."""
from __future__ import annotations

import pytest

from ftexpert.gpu_worker.engine import SamplingParams
from tests.built_engines import build, engine_of
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, save_hf

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A qwen3 model with strong random weights (attention far from uniform, so a KV mix-up shows)."""
    return build(save_hf(hf_model("qwen3", seed=11), tmp_path_factory.mktemp("qwen3")), max_context_tokens=256)


def solo(tiny, prompt, params=GREEDY, chunk=512):
    engine = engine_of(tiny, max_running_requests=1, max_context_tokens=256, prefill_chunk_tokens=chunk)
    return engine.generate([prompt], params)[0]


def drain(engine, tokens):
    while engine.has_work():
        for rid, token, finished, reason, _ in engine.step():
            tokens.setdefault(rid, []).append(token)


def test_requests_joining_and_leaving_between_steps_match_solo_runs(tiny):
    vocab = tiny.cfg.vocab_size
    prompts = {name: prompt_ids(n, seed=i, vocab=vocab)
               for i, (name, n) in enumerate([("a", 7), ("b", 40), ("c", 3), ("d", 9), ("e", 15)])}
    expected = {name: solo(tiny, p) for name, p in prompts.items()}
    engine = engine_of(tiny, max_running_requests=2, max_context_tokens=256, prefill_chunk_tokens=8)
    tokens: dict = {}
    engine.add_request(prompts["a"], GREEDY, request_id="a")
    for _ in range(3):
        for rid, token, _, _, _ in engine.step():
            tokens.setdefault(rid, []).append(token)
    # b prefills in 5 chunks while a decodes; c and d wait for a free KV row.
    for name in ("b", "c", "d"):
        engine.add_request(prompts[name], GREEDY, request_id=name)
    for _ in range(4):
        for rid, token, _, _, _ in engine.step():
            tokens.setdefault(rid, []).append(token)
    assert engine.abort("d") and not engine.abort("d")
    engine.add_request(prompts["e"], GREEDY, request_id="e")
    drain(engine, tokens)
    assert "d" not in tokens
    for name in ("a", "b", "c", "e"):
        assert tokens[name] == expected[name], name
    assert engine.stats.requests_finished == 4 and engine.stats.requests_aborted == 1


def test_running_request_aborted_frees_its_row_for_the_next(tiny):
    vocab = tiny.cfg.vocab_size
    p1, p2, p3 = (prompt_ids(n, seed=20 + n, vocab=vocab) for n in (6, 8, 10))
    engine = engine_of(tiny, max_running_requests=2, max_context_tokens=256)
    r1 = engine.add_request(p1, GREEDY)
    r2 = engine.add_request(p2, GREEDY)
    r3 = engine.add_request(p3, GREEDY)
    tokens: dict = {}
    for _ in range(4):
        for rid, token, _, _, _ in engine.step():
            tokens.setdefault(rid, []).append(token)
    assert r3 not in tokens                    # waiting: both rows are taken
    assert engine.abort(r1)                    # r3 takes r1's row (0); r2 stays in row 1
    drain(engine, tokens)
    assert tokens[r2] == solo(tiny, p2)
    assert tokens[r3] == solo(tiny, p3)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_gives_the_same_tokens(tiny, chunk):
    prompt = prompt_ids(37, seed=5, vocab=tiny.cfg.vocab_size)
    assert solo(tiny, prompt, chunk=chunk) == solo(tiny, prompt, chunk=512)


def test_step_outputs_and_stats(tiny):
    engine = engine_of(tiny, max_running_requests=2, max_context_tokens=64, prefill_chunk_tokens=4)
    assert not engine.has_work() and engine.step() == []
    rid = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert engine.step() == []                 # first chunk (4 tokens): no token yet
    (out,) = engine.step()                     # last chunk: the first token
    assert out.request_id == rid and not out.finished and out.finish_reason is None
    engine.step()
    (last,) = engine.step()
    assert last.finished and last.finish_reason == "length" and not engine.has_work()
    s = engine.stats
    assert (s.prefill_tokens, s.num_prefill_chunks, s.decode_tokens, s.generated_tokens) == (6, 2, 2, 3)
    assert s.prefill_time_s > 0 and s.decode_time_s > 0 and s.as_dict()["decode_tokens_per_s"] > 0
