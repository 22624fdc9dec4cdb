"""The lookahead prefetch in the hybrid backend (CPU worker processes, host hand-off on the CPU), turned on live by
SetPolicy's fields: the same greedy tokens as prefetch off over 100 decode steps, batch 1 and 2, and good
predictions turn misses the fraction rule leaves to the CPU pool into GPU hits.

Logits are compared to a tolerance, not bit for bit: the prefetch changes which experts the CPU pool computes, and
the CPU kernel's fp32 sums group differently from the GPU pool's GEMMs (test_hybrid.py's MAX_REL_DIFF: a wrong
route or weight is off by O(1)); hybrid with any two fetch fractions differs in the same last bits."""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels.slot_cache import reset
from tests.built_engines import build_with_resources
from tests.gpu_worker.prefetch_util import decode_run, open_windows
from tests.gpu_worker.test_hybrid import TEST_WORKER_ARGS, options_for_tests

STEPS = 100
MAX_REL_DIFF = 1e-4          # |on - off|_max / |off|_max per forward's logits


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        loaded = build_with_resources("hybrid", cache_size=8, worker_args=TEST_WORKER_ARGS, max_context_tokens=512,
                                      hybrid=options_for_tests(fetch_fraction=0.5))
        yield loaded
        loaded.model.experts.close()


def _run(loaded, mode: str, batch: int):
    backend = loaded.model.experts
    reset(backend.cache)
    backend.set_policy(prefetch=mode, prefetch_budget=2)
    if mode == "auto":
        open_windows(backend)
    before = backend.counters()
    run = decode_run(loaded, batch=batch, decode_steps=STEPS)
    after = backend.counters()
    return run, {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}


@pytest.mark.parametrize("batch, mode", [(1, "on"), (2, "on"), (1, "auto")])
def test_hybrid_prefetch_on_gives_off_tokens_and_moves_cpu_misses_to_gpu_hits(hybrid, batch, mode):
    """on, and auto with an idle window measured (a right guess weighed by the fetch fraction, 0.5 here)."""
    (tokens_off, logits_off), off = _run(hybrid, "off", batch)
    (tokens_on, logits_on), on = _run(hybrid, mode, batch)
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off)
    for i, (a, b) in enumerate(zip(logits_off, logits_on)):
        if a.numel():
            rel = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
            assert rel <= MAX_REL_DIFF, f"forward {i}: logits differ by {rel:.3g} of their range"
    assert on["prefetch_installed_total"] > 0 and on["prefetch_useful_total"] > 0
    assert off["prefetch_installed_total"] == 0
    assert on["cpu_experts_total"] < off["cpu_experts_total"], "good predictions take experts off the CPU pool"
