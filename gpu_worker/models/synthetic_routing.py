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
"""
from __future__ import annotations

import torch


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
        self._by_position = torch.stack(layers, dim=0).to(device)                          # [L, P, K]
        self.skew, self.seed = skew, seed
        self.max_positions, self.top_k = max_positions, top_k
        self._positions: torch.Tensor | None = None      # the forward's positions (held: `is` stays exact)
        self._by_layer: torch.Tensor | None = None       # [L, T, K] ids of that forward

    @property
    def table(self) -> torch.Tensor:
        """[P, L, K]: the expert ids of position p at layer l (a view of the [L, P, K] storage, which
        gathers all layers of a forward in one launch)."""
        return self._by_position.transpose(0, 1)

    @classmethod
    def parse(cls, spec: str, cfg, max_positions: int, device) -> "SyntheticRouting | None":
        """'model' -> None (the router decides); 'zipf' or 'zipf:SKEW' -> a table for cfg's shape."""
        if spec == "model":
            return None
        name, _, value = spec.partition(":")
        if name != "zipf":
            raise ValueError(f"routing {spec!r}: use 'model' or 'zipf[:SKEW]' (e.g. zipf:1.0)")
        return cls(cfg.num_layers, cfg.num_experts, cfg.top_k, max_positions,
                   skew=float(value) if value else 1.0, device=device)

    def ids(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] int64 (device) -> expert ids [T, K] int64 of `layer` (contiguous).

        Layer 0, or positions other than the last call's tensor object, gathers every layer's ids at once;
        the later layers of the same forward slice that. A forward visits layer 0 first, so positions
        rewritten in place between forwards (a graph's static input) are gathered afresh."""
        if layer == 0 or positions is not self._positions:                     # (None until the first call)
            self._by_layer = self._by_position.index_select(1, positions)                          # [L, T, K]
            self._positions = positions
        return self._by_layer[layer]
