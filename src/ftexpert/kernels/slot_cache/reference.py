"""Plain reference of the slot-cache contract (docs/slot_cache.md), written for clarity.

Works on CPU copies of the state (numpy) and writes the result back, so it serves both as the
CPU implementation and as the lockstep oracle for the Triton kernels.
"""
from __future__ import annotations

import numpy as np
import torch

from ftexpert.kernels.slot_cache.fetch_rule import fetch_count
from ftexpert.kernels.slot_cache.state import FREQ_COUNT_CAP, SLOT_BITS, SlotCache


class _HostState:
    """numpy views of a cache's tensors; `commit()` writes changed ones back to the device."""

    NAMES = ("slot_for_id", "id_of_slot", "usage", "step", "expert_recency", "evict_slots",
             "src_indices", "num_indices", "num_missing_full", "prefetch_evict_slots",
             "prefetch_src_indices", "prefetch_num_indices", "mark", "expert_count")

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.on_cpu = cache.device.type == "cpu"
        for name in self.NAMES:
            t = getattr(cache, name)
            arr = t.numpy() if self.on_cpu else t.cpu().numpy()
            setattr(self, name, arr.reshape(-1))

    def commit(self) -> None:
        if self.on_cpu:
            return  # the arrays are views of the tensors
        for name in self.NAMES:
            getattr(self.cache, name).copy_(torch.from_numpy(getattr(self, name)).view(
                getattr(self.cache, name).shape))


def victim_key_values(usage: np.ndarray, owner: np.ndarray, expert_count: np.ndarray, freq_weight: int) -> np.ndarray:
    """The eviction key's value part (before the slot is packed below it): usage + 1, plus, with a frequency
    weight W > 0, W * min(routes of the owner so far, FREQ_COUNT_CAP) for a used slot (usage >= 1; empty and
    prefetched-unused slots keep their keys 0 and 1)."""
    value = usage + 1
    if freq_weight:
        counts = np.where(owner >= 0, expert_count[np.maximum(owner, 0)], 0)
        value = value + np.where(usage >= 1, freq_weight * np.minimum(counts, FREQ_COUNT_CAP), 0)
    return value


def _victims(st: _HostState, base: int, num_slots: int, step: int, count: int, freq_weight: int = 0) -> list[int]:
    """The `count` slots with the smallest (key value, slot) among those not used at `step`."""
    if count <= 0:
        return []
    usage = st.usage[base:base + num_slots]
    slots = np.arange(num_slots, dtype=np.int64)
    eligible = usage != step
    value = victim_key_values(usage, st.id_of_slot[base:base + num_slots].astype(np.int64), st.expert_count,
                              freq_weight)
    # (value, slot) order, as one int64 key; ineligible slots sort last
    key = np.where(eligible, (value << SLOT_BITS) | slots, np.iinfo(np.int64).max)
    count = min(count, int(eligible.sum()))
    if count == 0:
        return []
    first = np.argpartition(key, count - 1)[:count] if count < num_slots else slots
    first = first[np.argsort(key[first], kind="stable")]
    return [base + int(s) for s in first]


def _install(st: _HostState, slot: int, flat_id: int, usage: int) -> None:
    old = int(st.id_of_slot[slot])
    if old >= 0:
        st.slot_for_id[old] = -1
    st.id_of_slot[slot] = flat_id
    st.slot_for_id[flat_id] = slot
    st.usage[slot] = usage


def ensure_reference(cache: SlotCache, layer: int, expert_ids: torch.Tensor, *,
                     max_fetch: int, frac_q16: int, round_mode: int, promote: bool, seed: int) -> None:
    """In place: mark hits, fetch misses by policy, rewrite routes to slot ids or -1.

    `max_fetch >= 0` is the fixed cap; `max_fetch < 0` selects the fraction rule.
    """
    st = _HostState(cache)
    num_experts, num_slots = cache.num_experts, cache.num_slots
    base = cache.pool_base(layer)
    row = layer * num_experts
    step = int(st.step[0]) + 1
    st.step[0] = step

    ids = expert_ids.reshape(-1).cpu().numpy().astype(np.int64)
    routed = np.unique(ids[ids >= 0])                       # distinct experts, ascending
    st.mark[routed] = step
    slots = st.slot_for_id[row + routed]
    hits, misses = routed[slots >= 0], routed[slots < 0]
    st.usage[st.slot_for_id[row + hits]] = step             # 1. hits are used now

    recency = st.expert_recency[row + misses]               # 2. order the misses: most recently routed first
    misses = misses[np.lexsort((misses, -recency))]
    num_misses = len(misses)

    if max_fetch >= 0:                                      # 3. how many to fetch
        k = min(num_misses, max_fetch)
        promoted = False
    else:
        k = fetch_count(num_misses, frac_q16, round_mode, seed=seed, step=step, layer=layer)
        promoted = (promote and k == 0 and num_misses > 0
                    and st.expert_recency[row + misses[0]] >= 0)
        if promoted:
            k = 1
    k = min(k, num_slots - len(hits))

    victims = _victims(st, base, num_slots, step, k, cache.freq_weight)   # 4. evict and install
    if promoted and victims and st.usage[victims[0]] != -1:
        victims = []                                         # promotion only fills empty slots
    for i, (e, slot) in enumerate(zip(misses[:len(victims)], victims)):
        _install(st, slot, row + int(e), step)
        st.evict_slots[i] = slot
        st.src_indices[i] = int(e)
    st.num_indices[0] = len(victims)
    st.num_missing_full[0] = num_misses

    out = np.full(ids.shape, -1, dtype=np.int64)            # 5. rewrite routes
    valid = ids >= 0
    out[valid] = st.slot_for_id[row + ids[valid]]
    st.expert_recency[row + routed] = step                  # 6. recency (and routes seen, with freq_weight)
    if cache.freq_weight:
        np.add.at(st.expert_count, row + ids[(ids >= 0) & (ids < num_experts)], 1)
        if cache.freq_half_life and step % cache.freq_half_life == 0:
            st.expert_count >>= 1                           # aging: every expert's count, every layer
    st.commit()
    expert_ids.copy_(torch.from_numpy(out).view(expert_ids.shape).to(expert_ids.dtype))


def prefetch_ensure_reference(cache: SlotCache, layer: int, candidates: torch.Tensor, budget: int, *,
                              device_budget: torch.Tensor | None = None,
                              ranks_out: torch.Tensor | None = None) -> None:
    """Install the first `budget` (and at most `device_budget`) non-resident candidates as low-priority (usage 0)
    slots; `ranks_out`: each candidate's rank among the distinct valid non-resident ones, -1 for the others."""
    st = _HostState(cache)
    num_experts = cache.num_experts
    base = cache.pool_base(layer)
    row = layer * num_experts
    step = int(st.step[0])
    if device_budget is not None:
        budget = min(budget, max(int(device_budget.reshape(-1)[0]), 0))
    wanted: list[int] = []
    ranks: list[int] = []
    for e in candidates.reshape(-1).cpu().tolist():
        if 0 <= e < num_experts and e not in wanted and st.slot_for_id[row + e] < 0:
            ranks.append(len(wanted))
            wanted.append(e)
        else:
            ranks.append(-1)
    chosen = wanted[:budget]
    if ranks_out is not None and ranks:
        ranks_out.reshape(-1)[:len(ranks)].copy_(torch.tensor(ranks, dtype=ranks_out.dtype))
    victims = _victims(st, base, cache.num_slots, step, len(chosen), cache.freq_weight)
    for i, (e, slot) in enumerate(zip(chosen, victims)):
        _install(st, slot, row + e, 0)
        st.prefetch_evict_slots[i] = slot
        st.prefetch_src_indices[i] = e
    st.prefetch_num_indices[0] = len(victims)
    st.commit()
    if victims:   # usage 0 lowers keys: the kernels' victim list is no longer the smallest keys
        cache.forget_victims(base // cache.num_slots)


def prefetch_score_reference(routed: torch.Tensor, chosen: torch.Tensor, chosen_len: int,
                             num_chosen: torch.Tensor | None, counts: torch.Tensor, *,
                             cand: torch.Tensor | None = None, ranks: torch.Tensor | None = None, k: int = 0,
                             allow: torch.Tensor | None = None, seen: torch.Tensor | None = None,
                             hit: torch.Tensor | None = None, count_installed: bool = False) -> None:
    """The prefetch's scoring of one layer call (api.prefetch_score), one entry at a time."""
    routes = set(routed.reshape(-1).tolist())
    n = chosen_len if num_chosen is None else min(chosen_len, int(num_chosen.reshape(-1)[0]))
    picked = [e for e in chosen.reshape(-1)[:n].tolist() if e >= 0]
    add = [0] * counts.numel()
    add[0] = len(picked)
    add[1] = sum(e in routes for e in picked)
    add[2] = len(picked) if count_installed else 0
    add[3] = 1
    if cand is not None:
        ids, rk = cand.reshape(-1).tolist(), ranks.reshape(-1)[:cand.numel()].tolist()
        allowed = int(allow.reshape(-1)[0])
        seen_add, hit_add = [0] * (k + 1), [0] * (k + 1)
        for lane in range(k):
            e, r = (ids[lane], rk[lane]) if lane < len(ids) else (-1, -1)
            routed_here = e >= 0 and e in routes
            col = r if r >= 0 else k
            seen_add[col] += 1
            hit_add[col] += routed_here
            if 0 <= r < allowed:
                add[4] += 1
                add[5] += routed_here
        seen += torch.tensor(seen_add, dtype=seen.dtype, device=seen.device)
        hit += torch.tensor(hit_add, dtype=hit.dtype, device=hit.device)
    counts += torch.tensor(add, dtype=counts.dtype, device=counts.device)
