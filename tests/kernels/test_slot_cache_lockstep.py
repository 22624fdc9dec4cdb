"""Lockstep: the Triton kernels against the reference, call by call, state and routes equal.

On a machine without a GPU the kernels run in the Triton interpreter (conftest.py sets it up).
"""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels.slot_cache import SlotCache, ensure, prefetch_ensure
from tests.conftest import KERNEL_DEVICE
from tests.kernels.slot_cache_util import RouteGen, assert_same_state, check_invariants, check_victim_list

NUM_CALLS = 36


def run_lockstep(*, num_layers, num_experts, num_slots, per_layer, calls, slot_tile,
                 num_tokens=2, top_k=3, prefetch_every=0, seed=0, path="auto", victim_list=4,
                 freq_weight=0, freq_half_life=0, **policy):
    ref = SlotCache.create(num_layers, num_experts, num_slots, per_layer=per_layer, freq_weight=freq_weight,
                           freq_half_life=freq_half_life)
    ker = SlotCache.create(num_layers, num_experts, num_slots, per_layer=per_layer,
                           device=KERNEL_DEVICE, victim_list=victim_list, freq_weight=freq_weight,
                           freq_half_life=freq_half_life)
    gen = RouteGen(num_layers, num_experts, seed)
    fetched = 0
    for call in range(calls):
        layer = call % num_layers
        ids = gen.routes(layer, num_tokens, top_k)
        ids_ref, ids_ker = ids.clone(), ids.to(KERNEL_DEVICE)
        ensure(ref, layer, ids_ref, impl="reference", seed=seed, **policy)
        ensure(ker, layer, ids_ker, impl="triton", seed=seed, slot_tile=slot_tile, path=path,
               **policy)
        assert torch.equal(ids_ref, ids_ker.cpu()), f"call {call}: routes differ"
        assert_same_state(ref, ker, f"call {call}")
        check_victim_list(ker, f"call {call}")
        fetched += int(ref.num_indices)
        if prefetch_every and call % prefetch_every == prefetch_every - 1:
            cand = gen.candidates(5)
            nxt = (layer + 1) % num_layers
            prefetch_ensure(ref, nxt, cand, 2, impl="reference")
            prefetch_ensure(ker, nxt, cand.to(KERNEL_DEVICE), 2, impl="triton",
                            slot_tile=slot_tile)
            assert_same_state(ref, ker, f"prefetch after call {call}")
            check_victim_list(ker, f"prefetch after call {call}")
    check_invariants(ref)
    return ref, fetched


POOLS = {
    # name: (layers, experts, slots per pool, per_layer, slot tile)
    "one-tile": (3, 16, 24, False, 32),
    "several-tiles": (3, 16, 40, False, 16),
    "per-layer": (3, 16, 10, True, 16),
}
POLICIES = {
    "min-wait": dict(fetch_fraction=0.4, round_mode="min-wait"),
    "stochastic": dict(fetch_fraction=0.35, round_mode="stochastic"),
    "prefer-fetch": dict(fetch_fraction=0.3, round_mode="prefer-fetch"),
    "split": dict(fetch_fraction=0.45, round_mode="split"),
    "min-wait-nopromote": dict(fetch_fraction=0.2, round_mode="min-wait", promote=False),
    "zero-fraction-promote": dict(fetch_fraction=0.0, promote=True),
    "zero-fraction-nopromote": dict(fetch_fraction=0.0, promote=False),
    "offload": dict(fetch_fraction=1.0),
    "cap-0": dict(max_fetch=0),
    "cap-1": dict(max_fetch=1),
}


# (path, victim-list length): the decode kernel with a short victim list (its fast path and its
# rebuilds both run often) or none (every fetch scans), and the general kernel
KERNEL_VARIANTS = {"small-list": ("small", 4), "small-nolist": ("small", 0),
                   "general": ("general", 4)}


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_lockstep(pool, policy, variant):
    """`small`: the decode kernel, its pool scan split over programs; `general`: one program."""
    layers, experts, slots, per_layer, tile = POOLS[pool]
    path, vlist = KERNEL_VARIANTS[variant]
    ref, fetched = run_lockstep(num_layers=layers, num_experts=experts, num_slots=slots,
                                per_layer=per_layer, calls=NUM_CALLS, slot_tile=tile,
                                prefetch_every=4, path=path, victim_list=vlist, **POLICIES[policy])
    if policy not in ("cap-0", "zero-fraction-nopromote"):
        assert fetched > 0, "the sequence never fetched: it does not exercise the fetch path"


def offload_call(ref: SlotCache, ker: SlotCache, layer: int, rows, path: str, context: str) -> None:
    """One fetch-every-miss call on the reference and the kernel: same routes, same state."""
    a = torch.tensor(rows)
    b = a.clone().to(KERNEL_DEVICE)
    ensure(ref, layer, a, fetch_fraction=1.0, impl="reference")
    ensure(ker, layer, b, fetch_fraction=1.0, impl="triton", path=path)
    assert torch.equal(a, b.cpu()), f"{context}: routes differ"
    assert_same_state(ref, ker, context)


FREQ_POLICIES = ("min-wait", "offload", "zero-fraction-promote", "split")


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("policy", FREQ_POLICIES)
@pytest.mark.parametrize("weight, half_life", [(1, 0), (5, 7)], ids=["w1", "w5-half7"])
def test_lockstep_with_frequency_weight(pool, policy, variant, weight, half_life):
    """The frequency-weighted key (SlotCache.freq_weight, and the counts' aging, freq_half_life): kernels and
    reference in lockstep, the routes-seen counts included (assert_same_state compares expert_count), prefetches
    among the calls; the decode kernel runs without its victim list then (check_victim_list passes trivially)."""
    layers, experts, slots, per_layer, tile = POOLS[pool]
    path, vlist = KERNEL_VARIANTS[variant]
    ref, fetched = run_lockstep(num_layers=layers, num_experts=experts, num_slots=slots,
                                per_layer=per_layer, calls=NUM_CALLS, slot_tile=tile, num_tokens=3,
                                prefetch_every=4, path=path, victim_list=vlist, freq_weight=weight,
                                freq_half_life=half_life, **POLICIES[policy])
    total = int(ref.expert_count.sum())
    if half_life:
        assert 0 < total < NUM_CALLS * 3 * 3, "the counts were never halved"
    else:
        assert total == NUM_CALLS * 3 * 3, "every route is counted once"
    if policy != "zero-fraction-promote":
        assert fetched > 0


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_frequency_weight_keeps_the_often_routed_expert_that_lru_evicts(variant):
    """Two slots. Expert 0 is routed three times (last at step 3), then expert 1 (step 4), then 2 misses: LRU evicts
    expert 0 (least recently used), the weighted key evicts expert 1 (5 + 1*W = 7 against 4 + 3*W = 10, W = 2).
    Kernel and reference agree either way."""
    path, vlist = KERNEL_VARIANTS[variant]
    held = {}
    for weight in (0, 2):
        ref = SlotCache.create(1, 4, 2, freq_weight=weight)
        ker = SlotCache.create(1, 4, 2, device=KERNEL_DEVICE, victim_list=vlist, freq_weight=weight)
        for row in ([0], [0], [0], [1], [2]):
            offload_call(ref, ker, 0, [row], path, f"weight {weight}, routes {row}")
        held[weight] = sorted(e for e in range(4) if int(ref.slot_for_id[0, e]) >= 0)
    assert held == {0: [1, 2], 2: [0, 2]}


def test_frequency_weight_is_checked_and_fixed_at_creation():
    with pytest.raises(ValueError, match=r"freq_weight must be an int in \[0, 1024\]"):
        SlotCache.create(1, 4, 2, freq_weight=-1)
    for bad in (5000, True, 2.0):
        with pytest.raises(ValueError, match="freq_weight"):
            SlotCache.create(1, 4, 2, freq_weight=bad)
    for bad in (-1, True):
        with pytest.raises(ValueError, match="freq_half_life must be an int >= 0"):
            SlotCache.create(1, 4, 2, freq_weight=3, freq_half_life=bad)
    cache = SlotCache.create(1, 4, 2, freq_weight=3, freq_half_life=9)
    with pytest.raises(AttributeError, match="fixed at creation"):
        cache.freq_weight = 0
    with pytest.raises(AttributeError, match="fixed at creation"):
        cache.freq_half_life = 0
    assert (cache.clone().freq_weight, cache.clone().freq_half_life) == (3, 9)
    assert (cache.to("cpu").freq_weight, cache.to("cpu").freq_half_life) == (3, 9)


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_route_counts_halve_every_half_life(variant):
    """freq_half_life 3: after calls 3 and 6 every count (both layers) is halved, rounding down; kernels agree."""
    path, vlist = KERNEL_VARIANTS[variant]
    ref = SlotCache.create(2, 4, 4, freq_weight=2, freq_half_life=3)
    ker = SlotCache.create(2, 4, 4, device=KERNEL_DEVICE, victim_list=vlist, freq_weight=2, freq_half_life=3)
    seen = []
    for layer, rows in [(0, [[1, 1, 2]]), (1, [[3, 3, 3]]), (0, [[1, 0, 2]]), (0, [[1, 1, 1]]), (1, [[3, 2, 0]]),
                        (0, [[2, 2, 1]])]:
        offload_call(ref, ker, layer, rows, path, f"layer {layer}, routes {rows}")
        seen.append(ref.expert_count.tolist())
    # call 3 (step 3): layer 0 had [0:1, 1:3, 2:2], layer 1 [3:3] -> halved to [0, 1, 1, 0] and [0, 0, 0, 1]
    assert seen[2] == [[0, 1, 1, 0], [0, 0, 0, 1]]
    # calls 4-6 add layer 0 [1:3], layer 1 [0:1, 2:1, 3:1], layer 0 [1:1, 2:2]; step 6 halves again
    assert seen[5] == [[0, 2, 1, 0], [0, 0, 0, 1]]


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_frequency_counts_skip_padding_and_count_duplicates(variant):
    """expert_count counts every route (a duplicate twice) and never padding (-1); kernels equal the reference."""
    path, vlist = KERNEL_VARIANTS[variant]
    ref = SlotCache.create(2, 8, 6, freq_weight=4)
    ker = SlotCache.create(2, 8, 6, device=KERNEL_DEVICE, victim_list=vlist, freq_weight=4)
    calls = [(0, [[3, -1, 3], [5, 3, -1]]), (1, [[7, 7, 7]]), (0, [[-1, -1, 2]]), (0, [[3, 6, 1], [0, 4, 2]])]
    for layer, rows in calls:
        offload_call(ref, ker, layer, rows, path, f"layer {layer}, routes {rows}")
    assert ref.expert_count[0].tolist() == [1, 1, 2, 4, 1, 1, 1, 0]
    assert ref.expert_count[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 3]


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_victim_skips_a_hit_that_is_least_recently_used(variant):
    """Expert 0 sits in the LRU slot and is routed again with a miss: the miss must evict the
    next slot, not the hit (a scan or the victim list sees slot 0 first and has to skip it)."""
    path, vlist = KERNEL_VARIANTS[variant]
    ref = SlotCache.create(1, 8, 4)
    ker = SlotCache.create(1, 8, 4, device=KERNEL_DEVICE, victim_list=vlist)
    for row in ([0], [1], [2], [3], [0, 4], [5, 0, 1]):
        offload_call(ref, ker, 0, [row], path, f"routes {row}")
    # [0, 4]: slot 0 (expert 0, LRU) is a hit, so 4 went to slot 1; [5, 0, 1]: 1 missed again
    assert ref.slot_for_id[0, 0] == 0 and ref.slot_for_id[0, 4] == 1


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_the_most_recently_routed_miss_is_fetched_first(variant):
    """Selection: misses are fetched by descending recency (the step they were last routed), ties by
    ascending id. 2 then 6 miss unfetched (cap 0); [1, 2, 6, 7] with cap 2 fetches 6 and 2; [7, 3, 1]
    with cap 1 fetches 1 (1 and 7 last routed together, 3 never)."""
    path, vlist = KERNEL_VARIANTS[variant]
    ref = SlotCache.create(1, 8, 4)
    ker = SlotCache.create(1, 8, 4, device=KERNEL_DEVICE, victim_list=vlist)
    plans = []
    for row, cap in (([2], 0), ([6], 0), ([1, 2, 6, 7], 2), ([7, 3, 1], 1)):
        a = torch.tensor([row])
        b = a.clone().to(KERNEL_DEVICE)
        ensure(ref, 0, a, max_fetch=cap, impl="reference")
        ensure(ker, 0, b, max_fetch=cap, impl="triton", path=path)
        assert torch.equal(a, b.cpu()), f"routes {row}: routes differ"
        assert_same_state(ref, ker, f"routes {row}")
        plans.append(ref.src_indices[:int(ref.num_indices)].tolist())
    assert plans == [[], [], [6, 2], [1]]


def test_pool_goes_from_empty_to_full_and_evicts():
    ref, fetched = run_lockstep(num_layers=2, num_experts=16, num_slots=12, per_layer=False,
                                calls=40, slot_tile=16, fetch_fraction=1.0)
    assert int((ref.id_of_slot >= 0).sum()) == 12, "the pool never filled"
    assert fetched > 12, "nothing was evicted"


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("tile", [16, 32, 64])
def test_results_do_not_depend_on_tile_size(tile, variant):
    # 50 slots: 4, 2 and 1 tiles (or programs); the reference is the same in each case
    path, vlist = KERNEL_VARIANTS[variant]
    run_lockstep(num_layers=2, num_experts=32, num_slots=50, per_layer=False, calls=30,
                 slot_tile=tile, num_tokens=3, top_k=4, fetch_fraction=0.6, prefetch_every=3,
                 path=path, victim_list=vlist)


def test_large_calls_take_the_general_kernel():
    # 24 tokens x 3 = 72 routes: more than the decode kernel takes, so "auto" runs the general one
    run_lockstep(num_layers=2, num_experts=32, num_slots=40, per_layer=False, calls=12,
                 slot_tile=16, num_tokens=24, top_k=3, fetch_fraction=0.5)


def test_int32_routes_and_padding():
    ref = SlotCache.create(2, 8, 6)
    ker = SlotCache.create(2, 8, 6, device=KERNEL_DEVICE)
    for call, row in enumerate([[0, 1, -1], [2, -1, -1], [0, 3, 4], [-1, -1, -1], [5, 6, 7]]):
        ids = torch.tensor([row], dtype=torch.int32)
        a, b = ids.clone(), ids.to(KERNEL_DEVICE)
        ensure(ref, call % 2, a, fetch_fraction=1.0, impl="reference")
        ensure(ker, call % 2, b, fetch_fraction=1.0, impl="triton")
        assert torch.equal(a, b.cpu()) and a.dtype == torch.int32
        assert all(v == -1 for v, e in zip(a[0].tolist(), row) if e == -1), "padding rewritten"
        assert_same_state(ref, ker, f"call {call}")


@pytest.mark.parametrize("mode", ["min-wait", "stochastic", "prefer-fetch", "split"])
def test_device_policy_matches_arguments(mode):
    from ftexpert.kernels.slot_cache import set_policy
    a = SlotCache.create(2, 16, 12, device=KERNEL_DEVICE)
    b = SlotCache.create(2, 16, 12, device=KERNEL_DEVICE)
    set_policy(b, fetch_fraction=0.45, round_mode=mode, promote=False, seed=11)
    gen = RouteGen(2, 16, 3)
    for call in range(12):
        ids = gen.routes(call % 2, 2, 3).to(KERNEL_DEVICE)
        ia, ib = ids.clone(), ids.clone()
        ensure(a, call % 2, ia, fetch_fraction=0.45, round_mode=mode, promote=False,
               seed=11, impl="triton")
        ensure(b, call % 2, ib, use_device_policy=True, impl="triton")
        assert torch.equal(ia, ib)
        for name in ("slot_for_id", "usage", "num_indices"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_back_to_back_calls_without_host_copies():
    """Many calls queued without reading anything back, then one comparison at the end."""
    layers, experts, slots = 4, 32, 20
    ref = SlotCache.create(layers, experts, slots)
    ker = SlotCache.create(layers, experts, slots, device=KERNEL_DEVICE)
    gen = RouteGen(layers, experts, 5)
    batches = [gen.routes(c % layers, 2, 4) for c in range(40)]
    outs = torch.stack(batches).to(KERNEL_DEVICE)        # [calls, T, K], rewritten in place
    for c in range(40):
        ensure(ker, c % layers, outs[c], fetch_fraction=0.5, impl="triton", check_ids=False)
    for c, ids in enumerate(batches):
        ensure(ref, c % layers, ids, fetch_fraction=0.5, impl="reference")
    assert torch.equal(torch.stack(batches), outs.cpu())
    assert_same_state(ref, ker, "after 40 queued calls")


def test_large_pool_default_parts_list_fast_path_and_rebuilds():
    """A full pool above 2,048 slots at the default decode settings (1,024-slot parts, so several
    programs and the arrival merge; a 32-entry list), evicting used slots: calls served by the
    list alone and calls that rebuild it must both occur, each equal to the reference."""
    from ftexpert.kernels.slot_cache.api import SINGLE_PROGRAM_SLOTS
    layers, experts, slots = 4, 768, SINGLE_PROGRAM_SLOTS + 452
    ref = SlotCache.create(layers, experts, slots, victim_list=32)
    gen = RouteGen(layers, experts, 7, skew=0.2)
    call = 0
    while int((ref.id_of_slot >= 0).sum()) < slots:             # fill on the reference alone
        ensure(ref, call % layers, gen.routes(call % layers, 4, 10), fetch_fraction=1.0,
               impl="reference")
        call += 1
    ker = ref.clone().to(KERNEL_DEVICE)                        # the list starts empty
    served_by_list = rebuilt = 0
    for c in range(24):
        layer = (call + c) % layers
        ids = gen.routes(layer, 1, 10)
        ids_ker = ids.clone().to(KERNEL_DEVICE)
        before = ker.victim_keys.clone()
        ensure(ref, layer, ids, fetch_fraction=1.0, impl="reference")
        ensure(ker, layer, ids_ker, fetch_fraction=1.0, impl="triton")
        assert torch.equal(ids, ids_ker.cpu()), f"call {c}: routes differ"
        assert_same_state(ref, ker, f"call {c}")
        check_victim_list(ker, f"call {c}")
        if int(ref.num_indices) > 0:
            if torch.equal(before, ker.victim_keys):
                served_by_list += 1
            else:
                rebuilt += 1
    assert served_by_list > 0 and rebuilt > 0, (served_by_list, rebuilt)


def test_decode_kernel_at_its_packing_limits():
    # A 64-entry list and 64 routes (CAND = 128: a candidate's index uses all 7 bits of the packed
    # victim) over three programs, with several fetches a call (k > 1: each further victim is one more
    # reduction over the packed candidates) and list rebuilds.
    ref, fetched = run_lockstep(num_layers=2, num_experts=96, num_slots=150, per_layer=False, calls=16,
                                slot_tile=64, num_tokens=16, top_k=4, fetch_fraction=0.7, path="small",
                                victim_list=64)
    assert fetched > 150, "the pool never filled and evicted"


@pytest.mark.parametrize("device_budgets", [(0, 1, 3, 9), (2, -1, 5, 0)], ids=["rising", "mixed"])
def test_prefetch_device_budget_and_ranks_match_the_reference(device_budgets):
    """prefetch_ensure with a device-side budget (the `auto` prefetch's per-layer count, read by the kernel) and the
    per-candidate ranks among the non-resident ones: Triton and the reference in lockstep, the installs capped by
    min(budget, device budget), the ranks -1 for resident, duplicate and invalid candidates."""
    layers, experts, slots = 3, 16, 24
    ref = SlotCache.create(layers, experts, slots)
    ker = SlotCache.create(layers, experts, slots, device=KERNEL_DEVICE, victim_list=4)
    gen = RouteGen(layers, experts, 5)
    for call, allow in enumerate(device_budgets * 2):
        layer = call % layers
        ids = gen.routes(layer, 2, 3)
        ensure(ref, layer, ids.clone(), impl="reference", fetch_fraction=1.0)
        ensure(ker, layer, ids.to(KERNEL_DEVICE), impl="triton", fetch_fraction=1.0, slot_tile=32)
        nxt = (layer + 1) % layers
        cand = torch.cat([gen.candidates(6), torch.tensor([-1, 3, 3])])          # an invalid one, a duplicate
        resident = {e for e in range(experts) if int(ref.slot_for_id[nxt][e]) >= 0}
        ranks = {}
        for impl, cache, dev in (("reference", ref, "cpu"), ("triton", ker, KERNEL_DEVICE)):
            out = torch.full((cand.numel(),), 7, dtype=torch.int64, device=dev)
            prefetch_ensure(cache, nxt, cand.to(dev), 4, impl=impl, device_budget=torch.tensor([allow], device=dev),
                            ranks_out=out)
            ranks[impl] = out.cpu().tolist()
        assert_same_state(ref, ker, f"call {call}")
        assert ranks["reference"] == ranks["triton"], f"call {call}"
        want, expected = [], []
        for e in cand.tolist():
            fresh = 0 <= e < experts and e not in want and e not in resident
            expected.append(len(want) if fresh else -1)
            if fresh:
                want.append(e)
        assert ranks["reference"] == expected
        assert int(ref.prefetch_num_indices) == min(4, max(allow, 0), len(want))
