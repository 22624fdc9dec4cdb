"""Shared helpers for the slot-cache tests: skewed random routes and state comparison."""
from __future__ import annotations

import torch

from ftexpert.kernels.slot_cache import SlotCache
from ftexpert.kernels.slot_cache.audit import audit


class RouteGen:
    """Seeded routes with a skewed (Zipf-like) expert popularity per layer, as real routers show."""

    def __init__(self, num_layers: int, num_experts: int, seed: int, skew: float = 1.0):
        self.gen = torch.Generator().manual_seed(seed)
        self.num_experts = num_experts
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
        base = ranks.pow(-skew)
        self.weights = torch.stack([base[torch.randperm(num_experts, generator=self.gen)]
                                    for _ in range(num_layers)])        # [L, E]

    def routes(self, layer: int, num_tokens: int, top_k: int,
               dtype: torch.dtype = torch.int64) -> torch.Tensor:
        w = self.weights[layer].expand(num_tokens, -1)
        ids = torch.multinomial(w, top_k, replacement=False, generator=self.gen)  # [T, K]
        return ids.to(dtype)

    def candidates(self, num: int) -> torch.Tensor:
        return torch.randint(-1, self.num_experts, (num,), generator=self.gen)


def assert_same_state(ref: SlotCache, other: SlotCache, context: str) -> None:
    for name, tensor in ref.state_tensors().items():
        got = getattr(other, name).cpu()
        if not torch.equal(tensor.cpu(), got):
            diff = (tensor.cpu() != got).nonzero()[:8].tolist()
            raise AssertionError(f"{context}: state tensor {name!r} differs at {diff}: "
                                 f"reference {tensor.cpu().reshape(-1)[:16].tolist()} "
                                 f"kernel {got.reshape(-1)[:16].tolist()}")


def check_invariants(cache: SlotCache) -> None:
    """Slot maps inverse, no slot owned twice, usage consistent with occupancy (kernels.slot_cache.audit)."""
    problems = audit(cache)
    assert not problems, "; ".join(problems)


def check_victim_list(cache: SlotCache, context: str = "") -> None:
    """The decode kernel's victim list: per pool, entries ascending as built, owners as recorded,
    and its live entries (slot usage unchanged) are exactly the pool's smallest keys."""
    from ftexpert.kernels.slot_cache.reference import victim_key_values
    from ftexpert.kernels.slot_cache.state import KEY_NONE, SLOT_BITS
    usage, owners = cache.usage.cpu(), cache.id_of_slot.cpu()
    values = torch.from_numpy(victim_key_values(usage.numpy(), owners.numpy().astype("int64"),
                                                cache.expert_count.cpu().reshape(-1).numpy(), cache.freq_weight))
    keys_all, owner_all = cache.victim_keys.cpu(), cache.victim_owner.cpu()
    for pool in range(keys_all.shape[0]):
        base = pool * cache.num_slots
        keys = keys_all[pool][keys_all[pool] != KEY_NONE]
        assert torch.all(keys[1:] > keys[:-1]), f"{context}: pool {pool} list not ascending: {keys.tolist()}"
        slots = torch.arange(cache.num_slots)
        current = (values[base:base + cache.num_slots] << SLOT_BITS) | slots            # [S]
        entries = keys_all[pool]
        used = entries != KEY_NONE
        entry_slots = entries & ((1 << SLOT_BITS) - 1)
        live = used & (current[entry_slots.clamp(max=cache.num_slots - 1)] == entries)
        if not bool(live.any()):
            continue
        live_slots = set(entry_slots[live].tolist())
        for j in live.nonzero().reshape(-1).tolist():
            slot = int(entry_slots[j])
            assert int(owner_all[pool][j]) == int(owners[base + slot]), \
                f"{context}: pool {pool} list entry {j} (slot {slot}) records a stale owner"
        max_live = int(entries[live].max())
        smaller = set((current <= max_live).nonzero().reshape(-1).tolist())
        assert smaller <= live_slots, (f"{context}: pool {pool} slots {sorted(smaller - live_slots)[:8]} "
                                       f"have keys below the list's live entries but are not in it")
