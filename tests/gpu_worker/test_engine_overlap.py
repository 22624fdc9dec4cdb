"""EngineConfig.overlap_decode: the next decode step is queued (fed with this step's sampled ids on the device)
before this step's ids are read back. Every request's tokens and finish reasons must be those of the engine without
it, whoever joins, stops, is aborted or runs out of room meanwhile. On the CPU the steps run one after the other, so
these tests check the bookkeeping (positions, which tokens are kept, which are discarded); the GPU test runs the same in
CUDA graphs, where the steps do overlap."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import Engine, SamplingParams
from tests.built_engines import build, engine_of
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, save_hf

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A qwen3 model with strong random weights (attention far from uniform, so a position mix-up shows)."""
    return _build(save_hf(hf_model("qwen3", seed=11), tmp_path_factory.mktemp("qwen3")))


def _build(model_dir=None, **fields):
    return build(model_dir, max_running_requests=2, max_context_tokens=256, **fields)


def _engine(built, overlap: bool, **fields) -> Engine:
    conf = {"max_running_requests": 2, "max_context_tokens": 256, "prefill_chunk_tokens": 8, **fields}
    return engine_of(built, overlap_decode="on" if overlap else "off", **conf)


def _queued(engine: Engine, name) -> bool:
    return engine._ahead is not None and any(r.request_id == name for r in engine._ahead.reqs)


def _script(engine: Engine, prompts: dict, params: dict, abort_at: dict | None = None, join_at: dict | None = None):
    """Drive the engine step by step: requests in `prompts` (name -> ids) join at step `join_at[name]` (default 0),
    `abort_at[name]` aborts one after that many steps; with overlap, at the first step from then on at which a step
    of it is queued (`abort_at` then holds the step it happened at). Every StepOutput, by request: (token ids,
    finish reason)."""
    abort_at, join_at = abort_at if abort_at is not None else {}, join_at or {}
    out: dict = {}
    pending = dict(prompts)
    step = 0
    while pending or engine.has_work():
        for name in [n for n in pending if join_at.get(n, 0) <= step]:
            engine.add_request(pending.pop(name), params[name], request_id=name)
        for name, at in list(abort_at.items()):
            if at != step:
                continue
            if engine.overlap_decode and not _queued(engine, name):
                abort_at[name] = step + 1            # wait until a step of it is queued
            else:
                assert engine.abort(name)
        for o in engine.step():
            ids, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (ids + [o.new_token_id], o.finish_reason)
        step += 1
        assert step < 500
    return out


def test_tokens_match_the_engine_without_overlap_as_requests_join_leave_and_abort(tiny):
    vocab = tiny.cfg.vocab_size
    prompts = {n: prompt_ids(k, seed=i, vocab=vocab) for i, (n, k) in enumerate([("a", 7), ("b", 20), ("c", 3),
                                                                                 ("d", 9), ("e", 5)])}
    params = {"a": GREEDY, "b": SamplingParams(max_new_tokens=20, ignore_eos=True),
              "c": SamplingParams(max_new_tokens=5, ignore_eos=True),
              "d": SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
              "e": SamplingParams(max_new_tokens=9, temperature=1.3, top_k=20, seed=3, ignore_eos=True)}
    joins, aborts = {"b": 3, "c": 4, "d": 5, "e": 14}, {"b": 10}
    engine = _engine(tiny, True)
    got = _script(engine, prompts, params, aborts, joins)        # b aborted with a step of it queued: at step
    assert 10 <= aborts["b"] < 24                                 # aborts["b"] now, which the engine without overlap
    plain = _engine(tiny, False)                                  # then gets too
    expected = _script(plain, prompts, params, aborts, joins)
    assert got == expected and got["b"][1] is None and len(got["b"][0]) < 20
    assert plain.stats.decode_steps_ahead == 0 and engine.stats.decode_steps_ahead >= 10
    assert engine.stats.decode_tokens_discarded >= 1, "b was aborted with a step of it queued"
    assert engine.stats.generated_tokens == plain.stats.generated_tokens
    assert engine.stats.decode_tokens == plain.stats.decode_tokens


def test_a_stop_token_while_a_step_is_queued_discards_only_that_request_token(tiny):
    """a stops on a token it makes mid-way (found by a first run); b keeps decoding: the token queued for a after its
    stop is discarded, b's is kept, and both match the engine without overlap."""
    vocab = tiny.cfg.vocab_size
    prompts = {"a": prompt_ids(6, seed=40, vocab=vocab), "b": prompt_ids(11, seed=41, vocab=vocab)}
    free = _script(_engine(tiny, False), prompts, {"a": GREEDY, "b": GREEDY})
    stop = free["a"][0][4]
    assert stop not in free["a"][0][:4], "the seeded model's fifth token of a repeats an earlier one: pick another"
    params = {"a": SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,)), "b": GREEDY}
    plain = _engine(tiny, False)
    expected = _script(plain, prompts, params)
    engine = _engine(tiny, True)
    got = _script(engine, prompts, params)
    assert got == expected
    assert got["a"] == (free["a"][0][:5], "stop") and got["b"] == (free["b"][0], "length")
    assert engine.stats.decode_tokens_discarded == 1 and engine.stats.decode_steps_ahead > 0


def test_nothing_is_queued_past_a_length_end_or_a_full_context(tiny):
    """A request's last token by max_new_tokens or by a full context is known in advance: no step is queued past
    it, so nothing is discarded, and the tokens match."""
    vocab = tiny.cfg.vocab_size
    prompts = {"a": prompt_ids(20, seed=50, vocab=vocab), "b": prompt_ids(4, seed=51, vocab=vocab)}
    params = {"a": SamplingParams(max_new_tokens=40, ignore_eos=True), "b": SamplingParams(max_new_tokens=7,
                                                                                        ignore_eos=True)}
    plain = _engine(tiny, False, max_context_tokens=32)
    expected = _script(plain, prompts, params)
    engine = _engine(tiny, True, max_context_tokens=32)
    got = _script(engine, prompts, params)
    assert got == expected
    assert got["a"][1] == "length" and len(got["a"][0]) == 32 - 20 + 1      # the context ended it
    assert engine.stats.decode_tokens_discarded == 0 and engine.stats.decode_steps_ahead > 0


def test_offload_overlaps_its_steps():
    """Offload (the copy kernel for decode steps, DMA copies for prefill chunks) queues steps ahead and gives
    resident's tokens, with its counters read in full at the end."""
    from tests.gpu_worker.test_offload import PROMPT
    params = {"a": SamplingParams(max_new_tokens=20, ignore_eos=True), "b": GREEDY}
    prompts = {"a": list(PROMPT), "b": list(PROMPT[2:9])}
    resident = _script(_engine(_build(), False), prompts, params)
    loaded = _build(moe_strategy="offload", moe_cache_size=10)
    backend = loaded.experts
    try:
        engine = _engine(loaded, True)
        assert _script(engine, prompts, params) == resident
        assert engine.stats.decode_steps_ahead > 0
        counters = backend.counters()
        assert engine.stats.expert_misses_total == counters["expert_misses_total"] > 0
        assert engine.stats.expert_hits_total == counters["expert_hits_total"] > 0
    finally:
        backend.close()


def _stop_early(loaded, prompt) -> tuple[SamplingParams, int]:
    """Greedy params that stop `prompt` on the first token of its free run (after the first) not made before it, and
    how many tokens it then makes."""
    free = _engine(loaded, False).generate([prompt], GREEDY)[0]
    at = next(i for i, t in enumerate(free) if i >= 1 and t not in free[:i])
    return SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(free[at],)), at + 1


def test_an_engine_left_idle_by_a_stop_holds_no_step_and_whole_counters():
    """The last request stops on a token with a step of it queued: that step is taken before step() returns, so
    generate() leaves nothing on the device, its discarded token is counted, and the engine's expert counters are the
    backend's (offload, copy kernel)."""
    from tests.gpu_worker.test_offload import PROMPT
    loaded = _build(moe_strategy="offload", moe_cache_size=10)
    backend = loaded.experts
    try:
        params, n = _stop_early(loaded, list(PROMPT))
        want = _engine(loaded, False).generate([list(PROMPT)], params)
        engine = _engine(loaded, True)
        assert engine.generate([list(PROMPT)], params) == want and 2 <= len(want[0]) == n < 12
        assert not engine.has_work() and engine._ahead is None
        assert engine.stats.decode_tokens_discarded == 1 and engine.stats.decode_steps_ahead > 0
        c = backend.counters()
        assert (engine.stats.expert_hits_total, engine.stats.expert_misses_total) == \
            (c["expert_hits_total"], c["expert_misses_total"])
    finally:
        backend.close()


def test_slot_audits_keep_their_cadence_when_requests_join():
    """Joins make step() take the queued step first; the audit every 3 decode steps still runs at every third one."""
    from tests.gpu_worker.test_offload import PROMPT
    loaded = _build(moe_strategy="offload", moe_cache_size=10)
    backend = loaded.experts
    try:
        for overlap in (False, True):
            engine = _engine(loaded, overlap, moe_slot_audit=3, max_running_requests=4)
            engine.add_request(list(PROMPT), SamplingParams(max_new_tokens=30, ignore_eos=True), request_id=0)
            step = 0
            while engine.has_work():
                if step in (4, 9, 14, 19):
                    engine.add_request(list(PROMPT[2:6]), SamplingParams(max_new_tokens=3, ignore_eos=True),
                                       request_id=100 + step)
                engine.step()
                step += 1
            assert engine.stats.slot_audits == engine.stats.num_decode_steps // 3 > 0, overlap
            assert engine.stats.slot_audit_failures == 0
        assert engine.stats.decode_steps_ahead > 0
    finally:
        backend.close()


def test_without_overlap_nothing_is_queued(tiny):
    engine = _engine(tiny, False)
    engine.generate([prompt_ids(5, seed=60, vocab=tiny.cfg.vocab_size)], GREEDY)
    assert engine.stats.decode_steps_ahead == 0 and engine._ahead is None
    assert engine_of(tiny, overlap_decode="auto").overlap_decode is False, "off by default on the CPU"


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["resident", "offload"])
def test_gpu_overlapped_steps_in_cuda_graphs_give_the_tokens_without_overlap(strategy):
    """On CUDA, where the next step really runs while the host reads this one's ids: resident and offload (the copy
    kernel and its timing events inside the CUDA graphs) give the tokens of the engine without overlap, with greedy
    and seeded sampled requests joining and one stopping early."""
    loaded = build(device="cuda", max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=8,
                   **({} if strategy == "resident" else dict(moe_strategy="offload", moe_cache_size=9)))
    vocab = loaded.cfg.vocab_size
    prompts = {n: prompt_ids(k, seed=70 + i, vocab=vocab) for i, (n, k) in enumerate([("a", 9), ("b", 14), ("c", 4)])}
    params = {"a": SamplingParams(max_new_tokens=40, ignore_eos=True),
              "b": SamplingParams(max_new_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
              "c": SamplingParams(max_new_tokens=6, ignore_eos=True)}
    joins = {"b": 2, "c": 10}
    try:
        outs = []
        for overlap in (False, True):
            engine = engine_of(loaded, cuda_graphs="on", overlap_decode="on" if overlap else "off")
            outs.append((_script(engine, prompts, params, join_at=joins), engine))
            torch.cuda.synchronize()
        (plain, plain_engine), (got, engine) = outs
        assert got == plain
        assert engine.overlap_decode and engine.stats.decode_steps_ahead > 20
        assert engine.graphs is not None and engine.graphs.replays > 20
        if strategy == "offload":       # the backend's copy time is cumulative: both runs copied
            assert engine.stats.copy_time_s_total > plain_engine.stats.copy_time_s_total > 0
    finally:
        loaded.close()


def test_the_overlap_knob_reaches_the_engine_config(monkeypatch, capsys, tmp_path):
    """ft generate resolves --overlap-decode / FREETOKEN_OVERLAP_DECODE (flag > environment > auto) into
    EngineConfig.overlap_decode (auto: None, on CUDA); the engine reads no environment itself."""
    from ftexpert.coordinator.cli import main
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    seen = []
    init = Engine.__init__

    def recording(self, model, config=None, *a, **kw):
        seen.append(config.overlap_decode)
        init(self, model, config, *a, **kw)

    monkeypatch.setattr(Engine, "__init__", recording)
    argv = ["generate", "--prompt-ids", "5,17,42", "--max-new-tokens", "2", "--device", "cpu"]
    monkeypatch.delenv("FREETOKEN_OVERLAP_DECODE", raising=False)
    assert main(argv) == 0
    assert main(argv + ["--overlap-decode", "on"]) == 0
    monkeypatch.setenv("FREETOKEN_OVERLAP_DECODE", "off")
    assert main(argv) == 0
    assert main(argv + ["--overlap-decode", "auto"]) == 0
    capsys.readouterr()
    assert seen == [None, True, False, None]
    monkeypatch.setenv("FREETOKEN_OVERLAP_DECODE", "on")
    assert build(max_context_tokens=64).engine.overlap_decode is False, \
        "the engine reads no knob: None means on CUDA only"
