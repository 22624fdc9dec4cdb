"""Logprobs in the engine: each token's reported logprob and top alternatives equal a recomputation of the
sampler's distribution (RequestSampler.filtered_probs at the request's temperature, 1 for greedy, after the grammar
mask) from the logits the step sampled from; requests that did not ask get none; the TOKEN_BATCH wire round trip."""
from __future__ import annotations

import math

import pytest
import torch

from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR, build_engine
from ftexpert.gpu_worker.engine import Engine, EngineConfig
from ftexpert.gpu_worker.engine import engine as engine_module
from ftexpert.gpu_worker.engine.sampling import RequestSampler
from ftexpert.proto import engine_messages as em
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.grammar_spec import GrammarSpec
from ftexpert.proto.sampling_params import SamplingParams, TokenLogprobs
from tests.gpu_worker.grammar_util import FLAGS

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def built():
    return build_engine(EngineSpec(device="cpu", model=DEFAULT_MODEL_DIR, max_running_requests=4,
                                   max_context_tokens=512))


def test_logprobs_equal_a_recomputation_of_the_sampled_distribution(built, monkeypatch):
    seen = []                                # per sample_step call: {sampler id: (logits row, allowed or None)}
    real = engine_module.sample_step

    def spy(samplers, logits, masks):
        vocab = logits.shape[-1]
        seen.append({id(s): (logits[i].clone(), s.grammar.allowed(vocab) if s.grammar else None)
                     for i, s in enumerate(samplers)})
        return real(samplers, logits, masks)

    monkeypatch.setattr(engine_module, "sample_step", spy)
    engine = Engine(built.engine.model, EngineConfig(max_running_requests=4, max_context_tokens=512),
                    built.source.eos_token_ids, built.engine.grammars)
    tok = built.source.tokenizer
    requests = {
        "hot": SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=5, logprobs=5,
                              ignore_eos=True),
        "greedy": SamplingParams(max_new_tokens=12, logprobs=3, ignore_eos=True),
        "nucleus": SamplingParams(max_new_tokens=12, temperature=1.3, top_p=0.5, seed=1, logprobs=20,
                                  ignore_eos=True),
        "json": SamplingParams(max_new_tokens=40, logprobs=4, grammar=GrammarSpec.json_schema(FLAGS)),
    }
    for rid, params in requests.items():
        engine.add_request(tok.encode("And the king said"), params, request_id=rid)
    engine.add_request(tok.encode("Then"), SamplingParams(max_new_tokens=6, ignore_eos=True), request_id="none")
    samplers = {rid: engine.scheduler.find(rid).sampler for rid in [*requests, "none"]}
    outputs = {rid: [] for rid in samplers}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert all(o.logprobs is None for o in outputs["none"])
    checked = 0
    for rid, params in requests.items():
        calls = [c[id(samplers[rid])] for c in seen if id(samplers[rid]) in c]
        assert len(calls) == len(outputs[rid])
        asked = params.logprobs
        reference = RequestSampler(SamplingParams(temperature=params.temperature or 1.0, top_k=params.top_k,
                                                  top_p=params.top_p, seed=0), CPU)
        for out, (row, allowed) in zip(outputs[rid], calls):
            lp = out.logprobs
            if allowed is not None:
                row = row.masked_fill(~torch.isin(torch.arange(row.numel()), torch.tensor(sorted(allowed))),
                                      float("-inf"))
            ref = torch.log(reference.filtered_probs(row))
            assert lp.logprob <= 0 and math.isclose(lp.logprob, ref[out.new_token_id].item(), rel_tol=1e-4,
                                                    abs_tol=1e-4)
            finite = int(torch.isfinite(ref).sum())
            assert len(lp.top_ids) == min(asked, finite)
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            best = torch.topk(ref, len(lp.top_ids)).values
            assert torch.allclose(torch.tensor(lp.top_logprobs), best, rtol=1e-4, atol=1e-4)
            assert torch.allclose(ref[list(lp.top_ids)], torch.tensor(lp.top_logprobs), rtol=1e-4, atol=1e-4)
            if allowed is not None:
                assert set(lp.top_ids) <= allowed
            checked += 1
    assert checked == sum(len(outputs[r]) for r in requests)
    assert any(len(o.logprobs.top_ids) < 4 for o in outputs["json"])     # forced tokens: fewer alternatives


def test_token_batch_carries_logprobs_and_pays_nothing_without():
    plain = em.token_batch(1, [1, 2], [5, 6], [False, True], ["", "stop"], [None, None])
    assert plain.lp_counts == [] and plain.logprobs() == [None, None]
    lps = [TokenLogprobs(-0.5, (5, 9), (-0.5, -1.25)), None, TokenLogprobs(-2.0)]
    batch = em.token_batch(2, [1, 2, 3], [5, 6, 7], [False] * 3, [""] * 3, lps)
    back = em.decode(em.encode(batch))
    assert back.logprobs() == lps
    with pytest.raises(em.MessageError):
        em.TokenBatch(3, [1], [5], [False], [""], [2], [-0.1], [4]).logprobs()


def test_sampling_params_with_a_grammar_cross_the_link():
    params = SamplingParams(max_new_tokens=9, logprobs=3, grammar=GrammarSpec.json_schema(FLAGS, strict=False))
    add = em.decode(em.encode(em.AddRequest(7, em.pack_token_ids([1, 2]), params)))
    assert add.params == params and add.params.grammar.key() == params.grammar.key()
    assert em.decode(em.encode(em.AddRequest(8, b"", SamplingParams()))).params.grammar is None
    for bad in (dict(logprobs=21), dict(logprobs=-1), dict(logprobs=True), dict(grammar="json")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError):
        GrammarSpec("yaml", "x")
    with pytest.raises(ValueError):
        GrammarSpec("json_schema")


def test_rows_without_logprobs_or_grammar_pay_nothing(built, monkeypatch):
    from ftexpert.gpu_worker.engine import sampling
    from ftexpert.gpu_worker.engine.grammar import GrammarMasks

    calls = {"rows": [], "masked": []}
    real_rows, real_apply = sampling.logprob_rows, GrammarMasks.apply

    def rows_spy(params, logits, tokens, rows):
        calls["rows"].append(list(rows))
        return real_rows(params, logits, tokens, rows)

    def apply_spy(self, logits, rows, states):
        calls["masked"].append(list(rows))
        return real_apply(self, logits, rows, states)

    monkeypatch.setattr(sampling, "logprob_rows", rows_spy)
    monkeypatch.setattr(GrammarMasks, "apply", apply_spy)
    engine = Engine(built.engine.model, EngineConfig(max_running_requests=4, max_context_tokens=512),
                    built.source.eos_token_ids, built.engine.grammars)
    prompt = built.source.tokenizer.encode("And")
    engine.generate([prompt, prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert calls == {"rows": [], "masked": []} and engine._masks is None
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id="plain")
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=1), request_id="lp")
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, grammar=GrammarSpec.json_schema(FLAGS)),
                       request_id="json")
    while engine.has_work():
        engine.step()
    assert calls["rows"] and all(len(r) == 1 for r in calls["rows"])          # only the row that asked
    assert calls["masked"] and all(len(r) == 1 for r in calls["masked"])      # only the constrained row
