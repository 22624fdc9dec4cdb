"""ftexpert.workload.routing: every statistic against a brute-force reference on hand-made traces; the trace
file's round trip and its errors for corrupt and truncated files; a trace collected from a model."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from ftexpert.workload.model import ModelConfig, MoeLM, route
from ftexpert.workload.routing import CACHE_FRACTIONS, NUM_CANDIDATES, collect_trace, lru_hit_rates, routing_stats
from ftexpert.proto.routing_trace import RoutingTrace, TraceError, read_trace, write_trace


def random_trace(tokens=70, layers=3, experts=6, k=2, cands=5, starts=(0, 25, 41), seed=0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    routed = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(layers)]) for _ in range(tokens)])
    routed[10:20, 1] = routed[9, 1]                 # a run of repeats, so reuse is not just chance
    cand = np.stack([np.stack([rng.permutation(experts)[:cands] for _ in range(layers - 1)])
                     for _ in range(tokens)])
    cand[:, 0, 0] = routed[:, 1, 0]                 # a predictor that is partly right
    return RoutingTrace(experts, routed, cand, np.asarray(starts, dtype=np.int64))


# ---- brute force: plain lists and sets, one token at a time -------------------------------------

def bf_reuse(tr: RoutingTrace, layer: int) -> float:
    starts = set(tr.seq_starts.tolist())
    vals = [len(set(tr.experts[t, layer]) & set(tr.experts[t + 1, layer])) / tr.top_k
            for t in range(tr.num_tokens - 1) if t + 1 not in starts]
    return sum(vals) / len(vals)


def bf_lru(tr: RoutingTrace, capacity: int, global_pool: bool) -> list[float]:
    caches = [[] for _ in range(tr.num_layers)]
    hits = [0] * tr.num_layers
    for t in range(tr.num_tokens):
        for layer in range(tr.num_layers):
            cache = caches[0] if global_pool else caches[layer]
            keys = [(layer, int(e)) for e in tr.experts[t, layer]]
            hits[layer] += sum(1 for key in keys if key in cache)
            for key in reversed(keys):          # the top-1 ends most recent
                if key in cache:
                    cache.remove(key)
                cache.append(key)
                if len(cache) > capacity:
                    cache.pop(0)
    return [h / (tr.num_tokens * tr.top_k) for h in hits]


def bf_predictor(tr: RoutingTrace, layer: int, n: int) -> tuple[float, float]:
    n = min(n, tr.num_candidates)
    both = [len(set(tr.experts[t, layer]) & set(tr.candidates[t, layer - 1, :n])) for t in range(tr.num_tokens)]
    return sum(both) / len(both) / tr.top_k, sum(both) / len(both) / n


def bf_imbalance(tr: RoutingTrace, layer: int) -> float:
    counts = Counter(int(e) for e in tr.experts[:, layer].ravel())
    mean = tr.num_tokens * tr.top_k / tr.num_experts
    return max(counts.values()) / mean


def close(a, b) -> bool:
    return (a is None and b is None) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_statistics_match_brute_force(seed):
    tr = random_trace(seed=seed)
    stats = routing_stats(tr)
    per = stats["per_layer"]
    for layer in range(tr.num_layers):
        assert close(per["reuse"][layer], bf_reuse(tr, layer))
        assert close(per["imbalance"][layer], bf_imbalance(tr, layer))
        for f in CACHE_FRACTIONS:
            pct = round(f * 100)
            assert close(per[f"lru_layer_{pct}"][layer], bf_lru(tr, max(1, round(f * 6)), False)[layer])
            assert close(per[f"lru_global_{pct}"][layer], bf_lru(tr, max(1, round(f * 18)), True)[layer])
        for n, tag in ((tr.top_k, "k"), (NUM_CANDIDATES, "16")):
            if layer == 0:
                assert per[f"recall_{tag}"][0] is None and per[f"precision_{tag}"][0] is None
            else:
                recall, precision = bf_predictor(tr, layer, n)
                assert close(per[f"recall_{tag}"][layer], recall)
                assert close(per[f"precision_{tag}"][layer], precision)
    for name, values in per.items():
        present = [v for v in values if v is not None]
        assert close(stats["overall"][name], sum(present) / len(present))
    assert per["recall_k"][1] >= 0.5                 # the planted half-right predictor shows


def test_a_hand_computed_example():
    routed = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 1]]])
    tr = RoutingTrace(4, routed, np.zeros((4, 0, 2), dtype=np.int64), np.array([0]))
    stats = routing_stats(tr)
    assert stats["per_layer"]["reuse"] == [pytest.approx(1 / 3)]
    assert stats["per_layer"]["imbalance"] == [1.5]
    # capacity 2: token 1 hits expert 1, token 2 hits expert 2, token 3 misses both
    layer_rate, global_rate = lru_hit_rates(tr, 0.5)
    assert layer_rate.tolist() == [0.25] and global_rate.tolist() == [0.25]
    # a new sequence breaks the reuse pair that crosses it
    split = RoutingTrace(4, routed, np.zeros((4, 0, 2), dtype=np.int64), np.array([0, 2]))
    assert routing_stats(split)["per_layer"]["reuse"] == [pytest.approx(1 / 4)]


@pytest.mark.parametrize("experts", [6, 300])          # uint8 and uint16 ids
def test_trace_round_trip(tmp_path, experts):
    tr = random_trace(experts=experts, tokens=40, starts=(0, 13))
    path = write_trace(tmp_path / "t.trace", tr)
    back = read_trace(path)
    assert back.num_experts == experts
    for name in ("experts", "candidates", "seq_starts"):
        np.testing.assert_array_equal(getattr(back, name), getattr(tr, name))


def test_corrupt_and_truncated_traces_name_the_file(tmp_path):
    path = write_trace(tmp_path / "t.trace", random_trace())
    data = path.read_bytes()
    cases = {
        "short.trace": (data[:len(data) - 7], "truncated"),
        "header.trace": (data[:20], "truncated"),
        "flip.trace": (data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:], "corrupt"),
        "long.trace": (data + b"\0", "corrupt"),
        "other.trace": (b"PK\3\4 not a trace at all", "not a routing trace"),
        "empty.trace": (b"", "not a routing trace"),
    }
    for name, (blob, word) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(blob)
        with pytest.raises(TraceError, match=word) as info:
            read_trace(bad)
        assert str(bad) in str(info.value)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.trace")


def test_inconsistent_traces_are_refused():
    tr = random_trace()
    with pytest.raises(ValueError, match="outside"):
        RoutingTrace(3, tr.experts, tr.candidates, tr.seq_starts)
    with pytest.raises(ValueError, match="sequence starts"):
        RoutingTrace(6, tr.experts, tr.candidates, np.array([1, 5]))
    with pytest.raises(ValueError, match="candidates"):
        RoutingTrace(6, tr.experts, tr.candidates[:, :1], tr.seq_starts)


def test_collected_trace_is_the_models_routing():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                      head_dim=16, num_experts=20, top_k=3, moe_intermediate_size=16)
    model = MoeLM(cfg)
    model.init_weights(7)
    with torch.no_grad():                               # wider routers: no near-ties in the top-k
        for layer in model.layers:
            layer.mlp.gate.weight.mul_(20)
    model.eval()
    seqs = [[1, 5, 9, 2, 7], [3, 3, 8]]
    tr = collect_trace(model, seqs)
    assert tr.num_tokens == 8 and tr.seq_starts.tolist() == [0, 5] and tr.num_candidates == 16
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        model(torch.tensor([seqs[0]]))
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.layers):
        x = inputs[i].reshape(-1, cfg.hidden_size)
        _, ids = route(layer.mlp.gate(x), cfg.top_k, cfg.norm_topk_prob)
        np.testing.assert_array_equal(tr.experts[:5, i], ids.numpy())
        if i:
            probs = torch.softmax(layer.mlp.gate(inputs[i - 1].reshape(-1, cfg.hidden_size)), -1)
            np.testing.assert_array_equal(tr.candidates[:5, i - 1], probs.topk(16, -1).indices.numpy())
