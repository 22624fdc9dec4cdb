"""`ExpertBackend`: the one interface between the model / decode engine and the routed experts.

Every backend (`resident`, `offload`, `cpu`, `hybrid`) subclasses it; the model and the engine call these
methods directly and probe nothing. Methods a backend has no use for keep the defaults below, which say
what "nothing to do" means for each.

Call order, per engine step: `step_begin()`; per MoE layer `forward(...)` (eagerly or replayed from a CUDA
graph captured while `graph_safe(num_pairs)` held and keyed on `graph_key()`); `step_end()`. Between steps:
`counters()`, `set_policy(...)`, and, on a backend with a slot cache, `audit_slots(...)` / `reset_slots()`.
"""
from __future__ import annotations

import abc

import torch

from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout


class ExpertBackend(abc.ABC):
    num_layers: int
    num_experts: int
    layout: ExpertLayout
    has_slot_cache: bool = False       # a GPU expert slot cache that audit_slots / reset_slots act on

    @abc.abstractmethod
    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, partials: bool = False) -> torch.Tensor:
        """x [T, H], topk_ids / topk_weights [T, K] -> sum_k w_k * expert_k(x) [T, H], in x's dtype. partials: the
        caller takes the weighted per-route outputs w_k * expert_k(x) [T, K, H] fp32 instead where the backend has
        them without their sum (resident decode: one launch fewer; kernels/next_decode's add_rms_norm sums them in
        k order): a backend returns either."""

    def graph_safe(self, num_pairs: int) -> bool:
        """Whether a forward of `num_pairs` (token, expert) routes may be captured in a CUDA graph (no host
        sync, fixed shapes)."""
        return False

    def graph_key(self) -> tuple:
        """Host state a captured forward depends on besides shapes: a new key means new graphs."""
        return ()

    def preferred_prefill_chunk_tokens(self) -> int | None:
        """The prefill chunk the engine takes when none is configured (None: the engine's default)."""
        return None

    def decode_steps_may_overlap(self) -> bool:
        """Whether the engine may queue the next decode step before this one's tokens are read back."""
        return True

    def step_begin(self) -> None:
        """Before a decode step's forwards."""

    def step_end(self) -> bool:
        """After a decode step's forwards: False asks the engine to run the step again (the backend has made
        the re-run safe, e.g. by fetching every miss). Only a backend whose `step_may_fail` is True may."""
        return True

    def step_may_fail(self) -> bool:
        """Whether this decode step's `step_end` may return False. The engine keeps a copy of the step's linear-layer
        state rows (Qwen3-Next) only then, since a re-run must start from them: ~2 MiB a layer and sequence copied
        every step otherwise."""
        return False

    def set_policy(self, **fields) -> None:
        """The coordinator's fetch policy (coordinator/policy.py) whenever it changes; a backend without a
        fetch / CPU split has nothing to set."""

    def set_prefetch(self, settings, predictor) -> None:
        """The lookahead expert prefetch (gpu_worker/backends/offload/prefetch.py, docs/PREFETCH.md): `settings` a
        PrefetchSettings, `predictor` the next layer's candidates. Only a backend with a slot cache prefetches; the
        others accept off, and auto (the default: a prefetch where there is a slot cache, so nothing here)."""
        if settings.mode not in ("off", "auto"):
            raise ValueError(f"expert prefetch (mode {settings.mode}) needs a slot cache: --moe-strategy offload or "
                             f"hybrid, not {type(self).__name__}")

    def prefetch_counters(self) -> dict[str, int]:
        """The lookahead prefetch's cumulative counters (empty without a slot cache)."""
        return {}

    def counters(self) -> dict[str, float]:
        """Cumulative counters under EngineStats' names (hits, misses, fetched, bytes, ...)."""
        return {}

    def audit_slots(self, sample_slots: int = 0, probe_slots: int = 0, seed: int = 0) -> list[str]:
        """The slot cache's invariants checked on the host (has_slot_cache only): the problems found."""
        raise NotImplementedError(f"{type(self).__name__} has no slot cache to audit")

    def reset_slots(self) -> None:
        """Empty the slot cache in place (has_slot_cache only)."""
        raise NotImplementedError(f"{type(self).__name__} has no slot cache to reset")

    def expert_nbytes(self) -> int:
        """Bytes of one expert as it is stored."""
        return self.layout.expert_nbytes

    def nbytes(self) -> int:
        """GPU bytes this backend holds for experts."""
        return 0

    def close(self) -> None:
        """Release what the backend holds (slots, streams, CPU workers it owns); idempotent."""
