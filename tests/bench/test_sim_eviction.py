"""bench/sim_eviction.py: the replay of the slot cache's eviction on a hand-made routing table."""
from __future__ import annotations

import torch

from bench.sim_eviction import simulate


def table(prompt: list[int], decode: list[int]) -> torch.Tensor:
    """One layer, top-1: [positions, 1, 1]."""
    return torch.tensor(prompt + decode).view(-1, 1, 1)


def test_lru_and_lfu_differ_where_the_prompt_says_which_expert_is_popular():
    """3 experts, 2 slots. The prefill pass copies e0, e1, e2 in order: LRU then holds {e1, e2}; LFU evicts the
    expert the prompt routed least (e1, once; e2 has no count yet but is the newcomer being admitted) and holds
    {e0, e2}. Decode routes e0, e2, e0, e2: LRU misses e0 once, LFU never."""
    t = table([0, 0, 0, 1], [0, 2, 0, 2])
    assert simulate(t, 1, 3, 2, prompt=4, decode=4, policy="lru") == 1 / 4
    assert simulate(t, 1, 3, 2, prompt=4, decode=4, policy="lfu") == 0.0
    # pin:0.5 keeps e0 (the prompt's most routed) in one slot; the other slot is LRU: e2 stays there
    assert simulate(t, 1, 3, 2, prompt=4, decode=4, policy="pin:0.5") == 0.0


def test_a_cache_that_holds_every_expert_never_misses_and_a_tiny_one_misses_every_change():
    t = table([0, 1, 2, 3], [3, 1, 0, 2, 2])
    for policy in ("lru", "lfu", "pin:0.5", "pin:1.0"):
        assert simulate(t, 1, 4, 4, prompt=4, decode=5, policy=policy) == 0.0, policy
    # one slot, LRU: after the pass it holds e3; then 3 hit, 1 miss, 0 miss, 2 miss, 2 hit
    assert simulate(t, 1, 4, 1, prompt=4, decode=5, policy="lru") == 3 / 5


def test_the_weighted_key_keeps_the_expert_routed_most():
    """2 slots, 4 experts; decode routes 0, 0, 0, 1, 2, 0. LRU evicts expert 0 for 2 (0 is older than 1): 4 misses.
    w:4 (last use + 4 x routes) keeps 0 (key 4 + 12) and evicts 1 (key 5 + 4): 3 misses. w:0 is LRU."""
    t = table([3], [0, 0, 0, 1, 2, 0])
    assert simulate(t, 1, 4, 2, prompt=1, decode=6, policy="lru") == 4 / 6
    assert simulate(t, 1, 4, 2, prompt=1, decode=6, policy="w:0") == 4 / 6
    assert simulate(t, 1, 4, 2, prompt=1, decode=6, policy="w:4") == 3 / 6


def test_aging_halves_the_counts_after_the_call():
    """w:4:2 halves every count after calls 2, 4, 6 (the prefill pass is call 1): the expert routed three times
    early loses its protection, unlike w:4 (same table as above, where w:4 keeps expert 0)."""
    t = table([3], [0, 0, 0, 1, 2, 0])
    assert simulate(t, 1, 4, 2, prompt=1, decode=6, policy="w:4") == 3 / 6
    # halved at step 4, expert 0's count is 1: key 4 + 4 = 8 against expert 1's 5 + 4 = 9, so 2 evicts expert 0
    assert simulate(t, 1, 4, 2, prompt=1, decode=6, policy="w:4:2") == 4 / 6
