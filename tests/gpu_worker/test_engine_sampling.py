"""Sampling: temperature / top-k / top-p filters, per-request seeds, reproducibility under batching."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.sampling import RequestSampler
from tests.built_engines import build, engine_of
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, save_hf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(save_hf(hf_model("olmoe", seed=21), tmp_path_factory.mktemp("olmoe")), max_context_tokens=128)


def test_filters_keep_exactly_the_expected_tokens():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).log_softmax(0)      # probs sorted, p0 biggest
    probs = logits.exp()
    top2 = RequestSampler(SamplingParams(temperature=1.0, top_k=2, seed=0), CPU).filtered_probs(logits)
    assert torch.equal(top2 > 0, torch.tensor([True, True, False, False, False]))
    assert torch.allclose(top2[:2], probs[:2] / probs[:2].sum())
    # top_p: keep the smallest prefix whose mass reaches p (p0 + p1 = 0.770 < 0.85 <= p0 + p1 + p2 = 0.896)
    nucleus = RequestSampler(SamplingParams(temperature=1.0, top_p=0.85, seed=0), CPU).filtered_probs(logits)
    assert torch.equal(nucleus > 0, torch.tensor([True, True, True, False, False]))
    assert torch.allclose(nucleus.sum(), torch.tensor(1.0))
    tiny_p = RequestSampler(SamplingParams(temperature=1.0, top_p=0.01, seed=0), CPU).filtered_probs(logits)
    assert torch.equal(tiny_p > 0, torch.tensor([True, False, False, False, False]))
    hot = RequestSampler(SamplingParams(temperature=2.0, seed=0), CPU).filtered_probs(logits)
    assert torch.allclose(hot, torch.softmax(logits / 2.0, 0))


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([1.0, 0.0, -0.5, -3.0])
    sampler = RequestSampler(SamplingParams(temperature=0.7, top_k=3, seed=123), CPU)
    counts = torch.bincount(torch.stack([sampler.sample(logits) for _ in range(4000)]), minlength=4)
    expected = sampler.filtered_probs(logits) * 4000
    assert counts[3] == 0
    assert torch.all((counts[:3] - expected[:3]).abs() < 5 * expected[:3].sqrt() + 5)


def test_invalid_params_are_rejected():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_seeded_requests_are_reproducible_and_independent_of_the_batch(model):
    vocab = model.cfg.vocab_size
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=42, ignore_eos=True)
    prompt = prompt_ids(9, seed=1, vocab=vocab)
    alone = engine_of(model, max_running_requests=1, max_context_tokens=128).generate([prompt], params)[0]
    again = engine_of(model, max_running_requests=1, max_context_tokens=128).generate([prompt], params)[0]
    assert alone == again
    engine = engine_of(model, max_running_requests=3, max_context_tokens=128)
    other = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    mixed = engine.generate([prompt_ids(5, seed=2, vocab=vocab), prompt, prompt_ids(14, seed=3, vocab=vocab)],
                            params)[1]
    assert mixed == alone
    seed7 = engine_of(model, max_context_tokens=128).generate([prompt], other)[0]
    assert seed7 != alone                               # 16 draws at temperature 1: a different seed differs


def test_degenerate_sampling_equals_greedy(model):
    prompt = prompt_ids(12, seed=8, vocab=model.cfg.vocab_size)
    engine = engine_of(model, max_context_tokens=128)
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    top1 = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=3,
                                                    ignore_eos=True))[0]
    assert top1 == greedy
    unseeded = [engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.5, ignore_eos=True))[0]
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]                   # no seed: a fresh one per request
