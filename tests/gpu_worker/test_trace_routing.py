"""Trace replay (`--routing trace:FILE`): the model routes every position as the recorded trace did."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from tests.built_engines import build
from ftexpert.gpu_worker.models.synthetic_routing import SyntheticRouting
from ftexpert.proto.routing_trace import RoutingTrace, TraceError, write_trace

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8]


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def _trace(layers: int, experts: int, k: int, tokens: int, seed: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(layers)]) for _ in range(tokens)])
    cands = np.stack([np.stack([rng.permutation(experts)[:min(16, experts)] for _ in range(layers - 1)])
                      for _ in range(tokens)])
    return RoutingTrace(experts, ids.astype(np.int64), cands.astype(np.int64), np.array([0, tokens // 2]))


def test_replay_gives_the_recorded_routes_and_wraps(tmp_path):
    class Cfg:
        num_layers, num_experts, top_k = 3, 16, 4
    trace = _trace(3, 16, 4, 10)
    path = write_trace(tmp_path / "t.trace", trace)
    routing = SyntheticRouting.parse(f"trace:{path}", Cfg, 25, "cpu")
    positions = torch.arange(25)
    for layer in range(3):
        got = routing.ids(layer, positions).numpy()
        assert (got[:10] == trace.experts[:, layer]).all()
        assert (got[10:20] == trace.experts[:, layer]).all() and (got[20:] == trace.experts[:5, layer]).all()
    assert routing.candidates.shape == (25, 2, 16)
    assert (routing.candidates[:10].numpy() == trace.candidates).all()
    assert routing.source == f"trace:{path}"


def test_a_trace_of_another_shape_or_a_broken_file_is_refused_naming_it(tmp_path):
    class Cfg:
        num_layers, num_experts, top_k = 4, 16, 4
    path = write_trace(tmp_path / "t.trace", _trace(3, 16, 4, 10))
    with pytest.raises(ValueError, match=r"t.trace: 3 layers, 16 experts, top-4; the model has 4 layers"):
        SyntheticRouting.parse(f"trace:{path}", Cfg, 8, "cpu")
    broken = tmp_path / "cut.trace"
    broken.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(TraceError, match="cut.trace: truncated"):
        SyntheticRouting.parse(f"trace:{broken}", Cfg, 8, "cpu")
    with pytest.raises(TraceError, match="missing.trace: cannot read"):
        SyntheticRouting.parse(f"trace:{tmp_path / 'missing.trace'}", Cfg, 8, "cpu")


def _generate(routing: str, seen=None, **fields):
    """Greedy tokens of an engine whose spec names `routing` (--routing trace:FILE); `seen`: the ids every MoE layer
    is handed, recorded."""
    built = build(routing=routing, max_running_requests=1, max_context_tokens=64, prefill_chunk_tokens=64, **fields)
    try:
        if seen is not None:
            inner = built.experts.forward

            def forward(layer_idx, x, topk_ids, *args, **kwargs):
                seen.append((layer_idx, topk_ids.clone()))
                return inner(layer_idx, x, topk_ids, *args, **kwargs)
            built.experts.forward = forward
        return built.engine.generate([list(PROMPT)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    finally:
        built.close()


def test_the_model_routes_as_the_trace_and_offload_stays_lossless(tmp_path):
    cfg = build(max_context_tokens=8).cfg
    trace = _trace(cfg.num_layers, cfg.num_experts, cfg.top_k, 64, seed=4)
    routing = f"trace:{write_trace(tmp_path / 'r.trace', trace)}"
    seen: list = []
    want = _generate(routing, seen)
    prefill = [ids for layer, ids in seen if ids.shape[0] == len(PROMPT)]
    assert len(prefill) == cfg.num_layers
    for layer, ids in enumerate(prefill):
        assert (ids.numpy() == trace.experts[:len(PROMPT), layer]).all()
    decode = [ids for layer, ids in seen if ids.shape[0] == 1 and layer == 0]
    assert [int(d[0, 0]) for d in decode] == [int(x) for x in trace.experts[len(PROMPT):len(PROMPT) + len(decode), 0, 0]]
    assert _generate(routing, moe_strategy="offload", moe_cache_size=cfg.num_experts) == want
