"""bench/hbm_roofline.py: the experts a resident decode step reads, from the run's routing where it is known."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.hbm_roofline import routed_experts_per_layer, step_bytes  # noqa: E402
from tests.built_engines import build  # noqa: E402


class TableRouting:
    """ids(layer, positions) from a table: table[layer][position] = the experts of that token."""

    def __init__(self, table):
        self.table = table

    def ids(self, layer, positions):
        return torch.tensor([self.table[layer][int(p)] for p in positions])


def test_distinct_experts_a_layer_against_a_hand_count():
    # layer 0: step {pos 0, 1} -> {0, 1, 2} (3), step {1, 2} -> {1, 2} (2); layer 1: {3} (1) and {3, 4} (2)
    table = {0: {0: [0, 1], 1: [1, 2], 2: [2, 1]}, 1: {0: [3, 3], 1: [3, 3], 2: [4, 3]}}
    model = SimpleNamespace(routing_override=TableRouting(table), device=torch.device("cpu"),
                            cfg=SimpleNamespace(num_layers=2))
    assert routed_experts_per_layer(model, [[0, 1], [1, 2]]) == (3 + 2 + 1 + 2) / 4
    model.routing_override = None
    assert routed_experts_per_layer(model, [[0, 1]]) is None               # the model's router: not known ahead


def test_step_bytes_counts_the_routed_experts_or_their_bound():
    built = build()
    cfg = built.model.cfg
    bound = step_bytes(built.model, 1000, [10] * 3)
    assert bound["experts"] == cfg.num_layers * min(cfg.num_experts, 3 * cfg.top_k) * 1000
    assert bound["experts_per_layer"] == min(cfg.num_experts, 3 * cfg.top_k)
    routed = step_bytes(built.model, 1000, [10] * 3, experts_per_layer=2.5)
    assert routed["experts"] == cfg.num_layers * 2500
    assert routed["total"] - routed["experts"] == bound["total"] - bound["experts"]
