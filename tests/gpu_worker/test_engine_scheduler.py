"""Random interleavings of add_request / abort / step (hypothesis): KV rows are never shared, at most
max_running_requests run, every request ends exactly once, and every completed request has exactly
the tokens it gets when it runs alone."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftexpert.gpu_worker.engine import EngineConfig, SamplingParams
from tests.built_engines import build, engine_of
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, save_hf

PROMPT_LENGTHS = (1, 4, 9, 17)
MAX_NEW = (1, 3, 6)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    loaded = build(save_hf(hf_model("qwen3", seed=41), tmp_path_factory.mktemp("q")), max_running_requests=1,
                   max_context_tokens=64)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENGTHS]
    solo = loaded.engine
    longest = solo.generate(prompts, SamplingParams(max_new_tokens=max(MAX_NEW), ignore_eos=True))
    return loaded, prompts, longest


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPT_LENGTHS) - 1), st.sampled_from(MAX_NEW)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, max_running=st.integers(1, 3), chunk=st.sampled_from([2, 5, 64]))
def test_random_interleavings_keep_the_invariants(world, ops, max_running, chunk):
    loaded, prompts, longest = world
    engine = engine_of(loaded, max_running_requests=max_running, max_context_tokens=64, prefill_chunk_tokens=chunk)
    added: dict[int, tuple[int, int]] = {}        # request id -> (prompt index, max_new_tokens)
    tokens: dict[int, list[int]] = {}
    ended: dict[int, str] = {}

    def step():
        for out in engine.step():
            assert out.request_id not in ended, "a token after the request ended"
            tokens.setdefault(out.request_id, []).append(out.new_token_id)
            if out.finished:
                ended[out.request_id] = out.finish_reason
        running = engine.scheduler.running
        slots = [r.slot for r in running]
        assert len(running) <= max_running and len(set(slots)) == len(slots)
        assert all(0 <= s < max_running for s in slots)

    for op, a, b in ops:
        if op == "add":
            rid = engine.add_request(prompts[a], SamplingParams(max_new_tokens=b, ignore_eos=True))
            added[rid] = (a, b)
        elif op == "abort":
            was_live = a in added and a not in ended
            assert engine.abort(a) == was_live
            if was_live:
                ended[a] = "abort"
        else:
            for _ in range(a):
                step()
    while engine.has_work():
        step()
    assert set(ended) == set(added)
    for rid, (p, max_new) in added.items():
        if ended[rid] == "abort":
            assert len(tokens.get(rid, [])) < max_new
        else:
            assert ended[rid] == "length" and tokens[rid] == longest[p][:max_new]


def test_prefill_chunk_default_comes_from_the_expert_backend():
    """EngineConfig.prefill_chunk_tokens unset: the backend's preference where it has one (hybrid: test_hybrid.py),
    else DEFAULT_PREFILL_CHUNK_TOKENS, the same for resident and offload (their greedy tokens must agree, and the
    chunking decides the prefill GEMMs' shapes); a configured size always wins, and the scheduler cuts a long
    prompt by it."""
    from ftexpert.gpu_worker.engine.engine import DEFAULT_PREFILL_CHUNK_TOKENS
    resident = build(max_context_tokens=128)
    assert resident.engine.prefill_chunk_tokens == DEFAULT_PREFILL_CHUNK_TOKENS == 4096
    engine = engine_of(resident, prefill_chunk_tokens=24)
    assert engine.prefill_chunk_tokens == 24
    engine.generate([list(range(1, 60))], SamplingParams(max_new_tokens=1))
    assert engine.stats.num_prefill_chunks == 3                       # 24 + 24 + 11
    offload = build(moe_strategy="offload", moe_cache_size=32, max_context_tokens=128)
    try:
        assert offload.engine.prefill_chunk_tokens == DEFAULT_PREFILL_CHUNK_TOKENS
        assert engine_of(offload, prefill_chunk_tokens=512).prefill_chunk_tokens == 512
    finally:
        offload.close()
    with pytest.raises(ValueError, match="prefill_chunk_tokens=0 must be >= 1"):
        EngineConfig(prefill_chunk_tokens=0)
