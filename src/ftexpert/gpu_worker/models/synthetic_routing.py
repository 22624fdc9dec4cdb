"""Seeded synthetic routing for benchmarks of models with random weights.

A preset with seeded random weights routes almost every token of a layer to the same few experts
(its hidden states barely depend on the token), so a slot cache hardly ever misses and an offload
or hybrid benchmark measures nothing of the copy path. `SyntheticRouting` replaces the router's
expert choice with a table drawn once from a skewed popularity per layer:

    p_l(e) ~ rank_l(e) ** -skew     (rank_l: a seeded random permutation of the experts per layer)
    table[pos, l] = K distinct experts drawn from p_l, independently for every position

so the expert ids of a token depend on its position (the same for every backend, which keeps the
lossless checks meaningful) and consecutive tokens share experts only as often as popularity says.
The router still runs and supplies the weights of its own top-k, which are then paired with the
table's ids: the numerics are a benchmark's, not a model's. Lookups are a device gather (no host
sync), so CUDA graphs capture them: one gather of every layer's ids at layer 0 of a forward, which the
other layers slice (a real router costs one kernel a layer; this table should not cost two).

`trace:FILE` replays a trained model's routing instead (proto/routing_trace.py; `ft bench routing
--trace FILE` writes one): position p routes as the trace's token p did, layer by layer, in router rank
order (positions past the trace's end wrap around to its start). The trace's layers, experts and top-k
must be the model's. Its lookahead predictor's ranked candidates come along (`candidates`).
"""
from __future__ import annotations

import logging

import torch

from ftexpert.proto.routing_trace import read_trace

log = logging.getLogger(__name__)


class SyntheticRouting:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, max_positions: int, *,
                 skew: float = 1.0, seed: int = 0, device: torch.device | str = "cpu"):
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
        if skew < 0:
            raise ValueError(f"skew must be >= 0, got {skew}")
        gen = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-skew)         # [E]
        layers = []
        for _ in range(num_layers):
            popularity = ranks[torch.randperm(num_experts, generator=gen)]                 # [E]
            draws = torch.multinomial(popularity.expand(max_positions, -1), top_k,
                                      replacement=False, generator=gen)                    # [P, K]
            layers.append(draws)
        self.skew, self.seed = skew, seed
        self._use_table(torch.stack(layers, dim=0).to(device), f"zipf:{skew:g}", None)

    def _use_table(self, by_position: torch.Tensor, source: str, candidates: torch.Tensor | None) -> None:
        self._by_position = by_position                                                    # [L, P, K]
        self.source = source
        self.candidates = candidates                     # trace replay: [P, L-1, C] predictor candidates
        self._candidates_dev = (None if candidates is None else                       # [P, L-1, C] int64
                                candidates.to(by_position.device, torch.int64))
        self.max_positions, self.top_k = by_position.shape[1], by_position.shape[2]
        self._positions: torch.Tensor | None = None      # the forward's positions (held: `is` stays exact)
        self._by_layer: torch.Tensor | None = None       # [L, T, K] ids of that forward

    @property
    def table(self) -> torch.Tensor:
        """[P, L, K]: the expert ids of position p at layer l (a view of the [L, P, K] storage, which
        gathers all layers of a forward in one launch)."""
        return self._by_position.transpose(0, 1)

    @classmethod
    def parse(cls, spec: str, cfg, max_positions: int, device) -> "SyntheticRouting | None":
        """'model' -> None (the router decides); 'zipf' or 'zipf:SKEW' -> a table for cfg's shape;
        'trace:FILE' -> the trace's routes."""
        if spec == "model":
            return None
        name, _, value = spec.partition(":")
        if name == "trace" and value:
            return cls.from_trace(value, cfg, max_positions, device)
        if name != "zipf":
            raise ValueError(f"routing {spec!r}: use 'model', 'zipf[:SKEW]' (e.g. zipf:1.0) or 'trace:FILE'")
        return cls(cfg.num_layers, cfg.num_experts, cfg.top_k, max_positions,
                   skew=float(value) if value else 1.0, device=device)

    @classmethod
    def from_trace(cls, path: str, cfg, max_positions: int, device) -> "SyntheticRouting":
        """The routes of a recorded trace (TraceError naming the file when it is unreadable)."""
        trace = read_trace(path)
        want = (cfg.num_layers, cfg.num_experts, cfg.top_k)
        have = (trace.num_layers, trace.num_experts, trace.top_k)
        if have != want:
            raise ValueError(f"routing trace {path}: {have[0]} layers, {have[1]} experts, top-{have[2]}; the "
                             f"model has {want[0]} layers, {want[1]} experts, top-{want[2]}: record the trace "
                             "from a checkpoint of the model's routing shape")
        if trace.num_tokens < max_positions:
            log.info("routing trace %s: %d tokens; positions past them wrap around", path, trace.num_tokens)
        wrap = torch.arange(max_positions) % trace.num_tokens                                # [P]
        self = cls.__new__(cls)
        experts = torch.from_numpy(trace.experts)[wrap]                                     # [P, L, K]
        self.skew, self.seed = None, None
        self._use_table(experts.transpose(0, 1).contiguous().to(device), f"trace:{path}",
                        torch.from_numpy(trace.candidates)[wrap])                          # [P, L-1, C]
        return self

    def ids(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] int64 (device) -> expert ids [T, K] int64 of `layer` (contiguous).

        Layer 0, or positions other than the last call's tensor object, gathers every layer's ids at once;
        the later layers of the same forward slice that. A forward visits layer 0 first, so positions
        rewritten in place between forwards (a graph's static input) are gathered afresh."""
        if layer == 0 or positions is not self._positions:                     # (None until the first call)
            self._by_layer = self._by_position.index_select(1, positions)                          # [L, T, K]
            self._positions = positions
        return self._by_layer[layer]

    def lookahead(self, layer: int) -> torch.Tensor:
        """The trace's recorded predictor candidates [T, C] (rank order) for `layer` (1..L-1) at the positions of
        the current forward (the last `ids` call's): what the live predictor would have ranked (no host sync)."""
        if self._candidates_dev is None:
            raise ValueError(f"routing {self.source} records no predictor candidates (only a trace:FILE does)")
        if self._positions is None or not 1 <= layer < self._by_position.shape[0]:
            raise ValueError(f"lookahead({layer}): needs a forward's ids first and a layer in 1..L-1")
        return self._candidates_dev.index_select(0, self._positions)[:, layer - 1]
