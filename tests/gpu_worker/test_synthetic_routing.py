"""Synthetic routing for benchmarks: a seeded table of distinct expert ids per position and layer,
used by the model in place of the router's choice, the same for every backend."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from tests.built_engines import build
from ftexpert.gpu_worker.models.synthetic_routing import SyntheticRouting

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8]


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def test_table_is_seeded_distinct_and_skewed():
    a = SyntheticRouting(4, 16, 3, 512, skew=1.2, seed=7)
    b = SyntheticRouting(4, 16, 3, 512, skew=1.2, seed=7)
    assert torch.equal(a.table, b.table) and a.table.shape == (512, 4, 3)
    assert all(len(set(row.tolist())) == 3 for row in a.table.reshape(-1, 3)), "ids repeat in a row"
    counts = torch.bincount(a.table[:, 0].reshape(-1), minlength=16)
    assert counts.max() > 3 * counts.min().clamp(min=1), "no skew: popularity looks uniform"
    flat = SyntheticRouting(1, 16, 3, 4096, skew=0.0, seed=1).table.reshape(-1)
    uniform = torch.bincount(flat, minlength=16).float()
    assert uniform.max() / uniform.min() < 1.3, "skew 0 should be uniform"
    pos = torch.tensor([3, 0, 511])
    assert torch.equal(a.ids(2, pos), a.table[pos, 2])


def test_one_gather_a_forward_and_fresh_ids_for_new_or_rewritten_positions():
    r = SyntheticRouting(5, 32, 4, 64, seed=3)
    pos = torch.tensor([9, 2])
    for layer in range(5):                                   # one forward: layer 0 gathers, the rest slice
        got = r.ids(layer, pos)
        assert got.is_contiguous() and torch.equal(got, r.table[pos, layer])
    gathered = r._by_layer
    r.ids(3, pos)
    assert r._by_layer is gathered, "a later layer of the same forward gathered again"
    pos[0] = 40                                              # a graph's static input, rewritten in place
    assert torch.equal(r.ids(0, pos), r.table[pos, 0]) and torch.equal(r.ids(4, pos), r.table[pos, 4])
    other = torch.tensor([7])                                # another tensor, even mid-forward
    assert torch.equal(r.ids(2, other), r.table[other, 2])


def test_parse_specs():
    class Cfg:
        num_layers, num_experts, top_k = 2, 8, 2
    assert SyntheticRouting.parse("model", Cfg, 16, "cpu") is None
    assert SyntheticRouting.parse("zipf:0.5", Cfg, 16, "cpu").skew == 0.5
    with pytest.raises(ValueError, match="zipf"):
        SyntheticRouting.parse("uniform", Cfg, 16, "cpu")


def _run(routing: str, **fields) -> tuple[list[list[int]], int | None]:
    """Greedy tokens of an engine whose spec names `routing` (--routing), and its offload backend's misses."""
    built = build(routing=routing, max_running_requests=1, max_context_tokens=64, prefill_chunk_tokens=4, **fields)
    try:
        assert (built.model.routing_override is None) == (routing == "model")
        tokens = built.engine.generate([list(PROMPT)], SamplingParams(max_new_tokens=16, ignore_eos=True))
        stats = getattr(built.experts, "stats", None)
        return tokens, stats.distinct_misses if stats is not None else None
    finally:
        built.close()


def test_offload_misses_more_and_stays_lossless_under_synthetic_routing():
    """The table comes from the engine spec (--routing zipf:0.5), the same for every backend."""
    want, _ = _run("zipf:0.5")
    cache = str(build(max_context_tokens=8).cfg.num_experts)
    got, with_table = _run("zipf:0.5", moe_strategy="offload", moe_cache_size=cache)
    assert got == want
    _, without = _run("model", moe_strategy="offload", moe_cache_size=cache)
    assert with_table > without, f"the table should miss more ({with_table} vs {without})"
