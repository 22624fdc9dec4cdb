"""Routing statistics of a trained checkpoint on held-out text.

    python -m ftexpert.workload.routing --model DIR [--tokens N] [--trace FILE] [--json FILE]

Per layer and overall:

- reuse: |top-k(t) & top-k(t+1)| / k for consecutive tokens of one sequence;
- LRU hit rate of an expert cache holding 10/25/50% of the experts, one pool per layer (capacity
  max(1, round(f * E))) and one global pool over all (layer, expert) pairs (max(1, round(f * E * L)));
  a token's experts hit if cached before that token, then are touched from the lowest-ranked to
  the top-1 (the top-1 is the most recent), evicting the least recently used; the global pool sees
  layers in order; the caches persist across sequences (a serving stream);
- recall and precision of the lookahead predictor (layer L's router on layer L-1's router input)
  at its top-k and top-16 candidates (layers 1..L-1);
- load imbalance: the busiest expert's share of picks over the mean share (1.0 is balanced).

``--trace FILE`` also writes the trace the statistics are computed from (see ``trace.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ftexpert.workload import corpus
from ftexpert.workload.checkpoint import META, load_checkpoint
from ftexpert.workload.model import MoeLM
from ftexpert.proto.routing_trace import RoutingTrace, write_trace
from ftexpert.workload.routing_args import add_arguments

CACHE_FRACTIONS = (0.10, 0.25, 0.50)
NUM_CANDIDATES = 16
WINDOW = 512


@torch.no_grad()
def collect_trace(model: MoeLM, sequences: list[list[int]], num_candidates: int = NUM_CANDIDATES
                  ) -> RoutingTrace:
    """Route every token of ``sequences`` (each run from position 0) and rank the predictor's picks."""
    cfg = model.cfg
    c = min(num_candidates, cfg.num_experts)
    experts, cands, starts, pos = [], [], [], 0
    for seq in sequences:
        ids = torch.tensor([seq], device=model.embed_tokens.weight.device)
        _, router_logits, router_inputs = model(ids, capture=True)
        experts.append(torch.stack([torch.topk(F.softmax(g, -1, dtype=torch.float), cfg.top_k, -1).indices
                                    for g in router_logits], 1).cpu())
        ranked = []
        for layer in range(1, cfg.num_layers):
            logits = model.layers[layer].mlp.gate(router_inputs[layer - 1])
            ranked.append(torch.topk(F.softmax(logits, -1, dtype=torch.float), c, -1).indices)
        cands.append(torch.stack(ranked, 1).cpu() if ranked else torch.empty(len(seq), 0, c, dtype=torch.long))
        starts.append(pos)
        pos += len(seq)
    return RoutingTrace(cfg.num_experts, torch.cat(experts).numpy(), torch.cat(cands).numpy(),
                        np.asarray(starts, dtype=np.int64))


def _onehot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    out = np.zeros((ids.shape[0], num_experts), dtype=bool)
    np.put_along_axis(out, ids, True, axis=1)
    return out


def reuse(trace: RoutingTrace) -> np.ndarray:
    """[L] mean |top-k(t) & top-k(t+1)| / k over consecutive pairs within a sequence."""
    same_seq = np.ones(trace.num_tokens - 1, dtype=bool) if trace.num_tokens > 1 else np.zeros(0, bool)
    same_seq[trace.seq_starts[1:] - 1] = False
    out = np.full(trace.num_layers, np.nan)
    if not same_seq.any():
        return out
    for layer in range(trace.num_layers):
        hot = _onehot(trace.experts[:, layer], trace.num_experts)
        both = (hot[:-1] & hot[1:]).sum(1)[same_seq]
        out[layer] = both.mean() / trace.top_k
    return out


class LruPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()

    def access(self, keys: list) -> int:
        """Hits among ``keys`` (rank order, best first) before they are touched; then touch them."""
        hits = sum(1 for key in keys if key in self.entries)
        for key in reversed(keys):
            self.entries[key] = None
            self.entries.move_to_end(key)
            if len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        return hits


def lru_hit_rates(trace: RoutingTrace, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """([L] per-layer-pool hit rates, [L] global-pool hit rates of each layer's accesses)."""
    e, layers = trace.num_experts, trace.num_layers
    per_layer = [LruPool(max(1, round(fraction * e))) for _ in range(layers)]
    pool = LruPool(max(1, round(fraction * e * layers)))
    hits_layer = np.zeros(layers)
    hits_global = np.zeros(layers)
    rows = trace.experts.tolist()
    for token in rows:
        for layer, ids in enumerate(token):
            hits_layer[layer] += per_layer[layer].access(ids)
            hits_global[layer] += pool.access([(layer, i) for i in ids])
    accesses = trace.num_tokens * trace.top_k
    return hits_layer / accesses, hits_global / accesses


def predictor_scores(trace: RoutingTrace, n: int) -> tuple[np.ndarray, np.ndarray]:
    """([L] recall, [L] precision) of the predictor's top-``n`` candidates (NaN at layer 0)."""
    n = min(n, trace.num_candidates)
    recall = np.full(trace.num_layers, np.nan)
    precision = np.full(trace.num_layers, np.nan)
    for layer in range(1, trace.num_layers):
        actual = _onehot(trace.experts[:, layer], trace.num_experts)
        guess = _onehot(trace.candidates[:, layer - 1, :n], trace.num_experts)
        both = (actual & guess).sum(1)
        recall[layer] = both.mean() / trace.top_k
        precision[layer] = both.mean() / n
    return recall, precision


def load_imbalance(trace: RoutingTrace) -> np.ndarray:
    """[L] max over experts of picks / mean picks."""
    out = np.zeros(trace.num_layers)
    for layer in range(trace.num_layers):
        counts = np.bincount(trace.experts[:, layer].ravel(), minlength=trace.num_experts)
        out[layer] = counts.max() / counts.mean()
    return out


def routing_stats(trace: RoutingTrace) -> dict:
    """Every statistic per layer (lists) and overall (the mean over the layers that have it)."""
    k = trace.top_k
    per_layer: dict[str, np.ndarray] = {"reuse": reuse(trace)}
    for f in CACHE_FRACTIONS:
        layer_rate, global_rate = lru_hit_rates(trace, f)
        per_layer[f"lru_layer_{round(f * 100)}"] = layer_rate
        per_layer[f"lru_global_{round(f * 100)}"] = global_rate
    for n, tag in ((k, "k"), (NUM_CANDIDATES, str(NUM_CANDIDATES))):
        recall, precision = predictor_scores(trace, n)
        per_layer[f"recall_{tag}"], per_layer[f"precision_{tag}"] = recall, precision
    per_layer["imbalance"] = load_imbalance(trace)
    overall = {name: (float(np.nanmean(v)) if np.isfinite(v).any() else None) for name, v in per_layer.items()}
    return {
        "tokens": trace.num_tokens, "sequences": len(trace.seq_starts), "layers": trace.num_layers,
        "experts": trace.num_experts, "top_k": k, "candidates": trace.num_candidates,
        "overall": overall,
        "per_layer": {name: [None if not np.isfinite(x) else float(x) for x in v]
                      for name, v in per_layer.items()},
    }


def format_stats(stats: dict) -> str:
    names = list(stats["overall"])
    head = ["layer"] + names
    widths = [max(6, len(n)) for n in head]
    lines = [f"{stats['tokens']} tokens in {stats['sequences']} sequences; {stats['layers']} layers, "
             f"{stats['experts']} experts, top-{stats['top_k']}; predictor candidates "
             f"{stats['candidates']} (recall/precision_k at top-{stats['top_k']})",
             "  ".join(h.rjust(w) for h, w in zip(head, widths))]

    def cell(x, w):
        return ("-" if x is None else f"{x:.3f}").rjust(w)
    for layer in range(stats["layers"]):
        row = [str(layer).rjust(widths[0])]
        row += [cell(stats["per_layer"][n][layer], w) for n, w in zip(names, widths[1:])]
        lines.append("  ".join(row))
    lines.append("  ".join(["all".rjust(widths[0])] + [cell(stats["overall"][n], w)
                                                       for n, w in zip(names, widths[1:])]))
    return "\n".join(lines)


def held_out_sequences(tok, tokens: int, window: int) -> list[list[int]]:
    """Held-out documents of the bundled corpus, cut into windows, ``tokens`` in all."""
    _, held = corpus.split(corpus.load_documents())
    seqs: list[list[int]] = []
    left = tokens
    for enc in tok.encode_batch(held):
        ids = enc.ids
        for i in range(0, len(ids), window):
            chunk = ids[i:i + min(window, left)]
            if len(chunk) >= 2:
                seqs.append(chunk)
                left -= len(chunk)
            if left <= 1:
                return seqs
    return seqs


def report(model_dir: Path, tokens: int, *, trace_path: Path | None = None, json_path: Path | None = None,
           device: str = "cpu") -> dict:
    """Route `tokens` held-out tokens through the checkpoint, print the statistics, and write the trace / JSON."""
    model, tok = load_checkpoint(model_dir, device)
    meta_path = model_dir / META
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("corpus") not in (
            None, corpus.KJV_PATH.name):
        print(f"note: {model_dir} was trained on another corpus; its held-out split of the bundled "
              f"corpus may overlap its training text", file=sys.stderr)
    window = min(WINDOW, model.cfg.max_position_embeddings)
    trace = collect_trace(model, held_out_sequences(tok, tokens, window))
    if trace_path:
        write_trace(trace_path, trace)
    stats = routing_stats(trace)
    print(format_stats(stats))
    if json_path:
        json_path.write_text(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routing", description="Routing statistics of a checkpoint "
                                "written by train_moe, on the corpus's held-out text.")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be at least 2")
    report(args.model, args.tokens, trace_path=args.trace, json_path=args.json, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
