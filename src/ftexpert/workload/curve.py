"""Routing statistics against tokens trained: the curve ``train_moe --curve-points N`` records.

At step 0 (random init) and at N-1 more steps spread evenly to the end, the model routes a fixed
held-out sample (``CURVE_TOKENS`` tokens, the same windows every time) and the overall statistics of
``routing.routing_stats`` are kept with the held-out loss. Evaluation time is not counted in the
training throughput. ``docs/WORKLOAD.md`` plots them (``python -m ftexpert.workload.curve_plot``).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ftexpert.workload.routing import WINDOW, collect_trace, held_out_sequences, routing_stats

CURVE_TOKENS = 4096
KEPT = ("reuse", "lru_layer_25", "lru_layer_50", "lru_global_25", "recall_k", "precision_k", "recall_16",
        "imbalance")


def curve_steps(total: int, points: int) -> set[int]:
    """Step 0 and ``points - 1`` more up to ``total`` (evenly spaced)."""
    if points <= 0:
        return set()
    if points == 1:
        return {total}
    return {0} | {max(1, round(total * i / (points - 1))) for i in range(1, points)}


class Curve:
    def __init__(self, tok, seq_len: int, points: int, log=print) -> None:
        self.points = points
        self.rows: list[dict] = []
        self.seconds = 0.0
        self.log = log
        self.seqs = held_out_sequences(tok, CURVE_TOKENS, min(WINDOW, seq_len)) if points else []

    @torch.no_grad()
    def record(self, model, step: int, tokens: int, held_loss: Callable[[], float]) -> None:
        t0 = time.perf_counter()
        loss = held_loss()
        was_training = model.training
        model.eval()
        with torch.compiler.set_stance("force_eager"):        # (windows of several lengths: no recompiles)
            stats = routing_stats(collect_trace(model, self.seqs))["overall"]
        model.train(was_training)
        row = {"step": step, "tokens": tokens, "held_out_loss": round(loss, 4),
               **{k: round(stats[k], 4) for k in KEPT if stats.get(k) is not None}}
        self.rows.append(row)
        self.seconds += time.perf_counter() - t0
        self.log("curve: " + " ".join(f"{k} {v}" for k, v in row.items()))
