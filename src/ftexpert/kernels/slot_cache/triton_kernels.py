"""Triton kernels of the slot-cache contract (docs/slot_cache.md): the general ensure kernel (any call size)
and the prefetch; the decode-sized ensure kernel is in triton_decode.py; `reference.py` is the oracle.

One program (grid (1,)) does a whole call: the work is sequential by nature (victim i+1 depends on
victim i) and small, so one block, scanning the pool in tiles of SLOT_TILE slots, keeps it to one
launch that a CUDA graph can replay.  Results do not depend on SLOT_TILE: victims are picked by a
strict total order on the packed key (usage + 1) << SLOT_BITS | slot, and the i-th victim is the
smallest key above the (i-1)-th, which equals picking one slot at a time and marking it used.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.slot_cache.triton_common import (_age_counts, _fetch_count, _install, _miss_expert, _next_miss, _next_victim,
                            _order_key)


@triton.jit
def ensure_kernel(
    ids_ptr,              # [N] int32|int64 routed expert ids (-1 = padding), rewritten in place
    num_routes,           # N
    slot_for_id_ptr,      # [L*E] int32
    id_of_slot_ptr,       # [P*S] int32
    usage_ptr,            # [P*S] int64
    step_ptr,             # [1] int64
    recency_ptr,          # [L*E] int64
    mark_ptr,             # [E] int64 scratch
    evict_ptr,            # [S] int32 copy plan: destination slots
    src_ptr,              # [S] int32 copy plan: layer-local expert rows
    num_indices_ptr,      # [1] int32
    num_missing_ptr,      # [1] int32
    error_ptr,            # [1] int32 error bits
    policy_ptr,           # [5] int64 device policy (read when USE_POLICY)
    count_ptr,            # [L*E] int64 routes seen per expert (read and counted when USE_FREQ)
    freq_weight,          # W of the frequency-weighted key (USE_FREQ)
    freq_half_life,       # halve every count after a call whose step is a multiple of this (0: never; USE_FREQ)
    num_counts,           # L*E
    layer,                # MoE layer of this call
    pool_base,            # first global slot of the layer's pool
    num_slots,            # S, slots in the pool
    max_fetch,            # fixed cap (>= 0) or -1 for the fraction rule
    frac_q16,             # f in Q16
    round_mode,           # 0 min-wait, 1 stochastic, 2 prefer-fetch, 3 split (floor)
    promote,              # recency promotion on (1) / off (0)
    seed,                 # stochastic seed
    NUM_EXPERTS: tl.constexpr,   # E
    E_BLOCK: tl.constexpr,       # next power of two >= E
    ROUTE_TILE: tl.constexpr,    # routes per tile
    SLOT_TILE: tl.constexpr,     # slots per tile of the victim scan
    USE_POLICY: tl.constexpr,    # read the policy scalars from policy_ptr
    USE_FREQ: tl.constexpr,      # the frequency-weighted key (freq_weight > 0)
):
    if USE_POLICY:
        max_fetch = tl.load(policy_ptr + 0)
        frac_q16 = tl.load(policy_ptr + 1)
        round_mode = tl.load(policy_ptr + 2)
        promote = tl.load(policy_ptr + 3)
        seed = tl.load(policy_ptr + 4)
    zero = tl.zeros((), tl.int64)   # widen scalar args (int32, or constexpr when specialised)
    max_fetch = max_fetch + zero
    frac_q16 = frac_q16 + zero
    round_mode = round_mode + zero
    promote = promote + zero
    seed = seed + zero
    layer = layer + zero
    freq_weight = freq_weight + zero
    freq_half_life = freq_half_life + zero
    step = tl.load(step_ptr) + 1
    row = layer * NUM_EXPERTS

    # A. mark every routed expert with this step (duplicates write the same value); with USE_FREQ count its routes
    # (only routed experts' counts change, and those are hits of this call or not in a slot: no victim key moves)
    for r0 in range(0, num_routes, ROUTE_TILE):
        offs = r0 + tl.arange(0, ROUTE_TILE)                             # [R]
        in_range = offs < num_routes
        e = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int64)
        bad = in_range & ((e < -1) | (e >= NUM_EXPERTS))
        tl.atomic_or(error_ptr, 1, mask=tl.max(bad.to(tl.int32), axis=0) > 0)
        tl.store(mark_ptr + e, step, mask=in_range & (e >= 0) & (e < NUM_EXPERTS))
        if USE_FREQ:
            tl.atomic_add(count_ptr + row + e, 1, mask=in_range & (e >= 0) & (e < NUM_EXPERTS))
    tl.debug_barrier()

    # B. hits and misses over all experts of the layer
    ev = tl.arange(0, E_BLOCK)                                           # [E_BLOCK]
    in_e = ev < NUM_EXPERTS
    routed = in_e & (tl.load(mark_ptr + ev, mask=in_e, other=-1) == step)
    slot = tl.load(slot_for_id_ptr + row + ev, mask=in_e, other=-1)
    hit = routed & (slot >= 0)
    miss = routed & (slot < 0)
    tl.store(usage_ptr + slot, step, mask=hit)
    tl.debug_barrier()   # the victim scans below must see every hit's usage == step
    num_hits = tl.sum(hit.to(tl.int64), axis=0)
    num_misses = tl.sum(miss.to(tl.int64), axis=0)
    rec = tl.load(recency_ptr + row + ev, mask=in_e, other=-1)
    order_key = _order_key(ev.to(tl.int64), rec, miss, E_BLOCK)
    first_key = tl.max(order_key, axis=0)

    # C. how many misses to fetch
    k, promoted = _fetch_count(num_misses, num_hits, num_slots, first_key, max_fetch, frac_q16,
                               round_mode, promote, seed, step, layer)

    # D. one victim per fetched miss, in order
    installed = tl.zeros((), tl.int32)
    cur = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)
    prev_victim = tl.full((), -1, tl.int64)
    for i in range(0, k):
        cur = _next_miss(order_key, cur)
        expert = _miss_expert(cur, E_BLOCK)
        vkey = _next_victim(usage_ptr, id_of_slot_ptr, count_ptr, freq_weight, pool_base, num_slots, step,
                            prev_victim, SLOT_TILE, USE_FREQ)
        prev_victim = vkey
        victim = pool_base + (vkey & ((1 << 25) - 1))
        victim_was_empty = (vkey >> 25) == 0
        if (promoted == 0) | victim_was_empty:
            _install(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, victim, row + expert, step)
            tl.store(evict_ptr + i, victim.to(tl.int32))
            tl.store(src_ptr + i, expert.to(tl.int32))
            installed += 1
    tl.store(num_indices_ptr, installed.to(tl.int32))
    tl.store(num_missing_ptr, num_misses.to(tl.int32))
    tl.debug_barrier()

    # E. rewrite routes: every thread loads its tile before any thread stores into it
    for r0 in range(0, num_routes, ROUTE_TILE):
        offs = r0 + tl.arange(0, ROUTE_TILE)
        in_range = offs < num_routes
        e = tl.load(ids_ptr + offs, mask=in_range, other=-1)
        valid = in_range & (e >= 0) & (e < NUM_EXPERTS)
        s = tl.load(slot_for_id_ptr + row + e, mask=valid, other=-1)
        out = tl.where(valid, s, -1).to(e.dtype)
        tl.debug_barrier()
        tl.store(ids_ptr + offs, out, mask=in_range)

    # F. recency, aging of the route counts (USE_FREQ; after the barriers since phase A's increments) and the step
    tl.store(recency_ptr + row + ev, step, mask=routed)
    if USE_FREQ:
        _age_counts(count_ptr, num_counts, step, freq_half_life)
    tl.store(step_ptr, step)


@triton.jit
def prefetch_kernel(
    cand_ptr,             # [C] int32|int64 candidate experts in priority order (-1 = none)
    num_cand,             # C
    budget,               # most installs
    slot_for_id_ptr,      # [L*E] int32
    id_of_slot_ptr,       # [P*S] int32
    usage_ptr,            # [P*S] int64
    step_ptr,             # [1] int64 (read only)
    evict_ptr,            # [S] int32 prefetch copy plan
    src_ptr,              # [S] int32
    num_indices_ptr,      # [1] int32
    vkeys_ptr,            # [V] int64 the pool's victim list: emptied when anything is installed
    count_ptr,            # [L*E] int64 routes seen per expert (USE_FREQ)
    freq_weight,
    layer, pool_base, num_slots,
    device_budget_ptr,    # [1] int32|int64: at most this many installs too (HAS_DEVICE_BUDGET)
    ranks_out_ptr,        # [C] int32|int64: each candidate's rank among the wanted, -1 for the rest (HAS_RANKS_OUT)
    NUM_EXPERTS: tl.constexpr,
    C_BLOCK: tl.constexpr,       # next power of two >= C
    SLOT_TILE: tl.constexpr,
    V_BLOCK: tl.constexpr,       # victim-list length (>= 1)
    USE_FREQ: tl.constexpr,
    HAS_DEVICE_BUDGET: tl.constexpr = False,
    HAS_RANKS_OUT: tl.constexpr = False,
):
    step = tl.load(step_ptr)
    row = layer * NUM_EXPERTS
    ci = tl.arange(0, C_BLOCK)                                           # [C]
    e = tl.load(cand_ptr + ci, mask=ci < num_cand, other=-1).to(tl.int64)
    valid = (e >= 0) & (e < NUM_EXPERTS)
    # first occurrence only: [C, C] comparison against earlier candidates
    same = (e[:, None] == e[None, :]) & (ci[None, :] < ci[:, None])
    dup = tl.max(same.to(tl.int32), axis=1) > 0
    resident = tl.load(slot_for_id_ptr + row + e, mask=valid, other=-1) >= 0
    want = valid & (dup == 0) & (resident == 0)
    rank = tl.cumsum(want.to(tl.int32), axis=0) - 1
    if HAS_RANKS_OUT:
        tl.store(ranks_out_ptr + ci, tl.where(want, rank, -1).to(ranks_out_ptr.dtype.element_ty), mask=ci < num_cand)
    if HAS_DEVICE_BUDGET:
        budget = tl.minimum(budget, tl.maximum(tl.load(device_budget_ptr).to(tl.int32), 0))
    chosen = want & (rank < budget)
    num_chosen = tl.sum(chosen.to(tl.int32), axis=0)

    # Pick every victim before installing any: an install sets usage 0, which would put the slot
    # back above the scan threshold and let a later pick take it again.
    installed = tl.zeros((), tl.int32)
    prev_victim = tl.full((), -1, tl.int64)
    for i in range(0, num_chosen):
        expert = tl.sum(tl.where(chosen & (rank == i), e, 0), axis=0)
        vkey = _next_victim(usage_ptr, id_of_slot_ptr, count_ptr, freq_weight + tl.zeros((), tl.int64), pool_base,
                            num_slots, step, prev_victim, SLOT_TILE, USE_FREQ)
        prev_victim = vkey
        if vkey != 0x7FFFFFFFFFFFFFFF:
            victim = pool_base + (vkey & ((1 << 25) - 1))
            tl.store(evict_ptr + installed, victim.to(tl.int32))
            tl.store(src_ptr + installed, expert.to(tl.int32))
            installed += 1
    tl.debug_barrier()
    for i in range(0, installed):
        victim = tl.load(evict_ptr + i).to(tl.int64)
        expert = tl.load(src_ptr + i).to(tl.int64)
        _install(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, victim, row + expert,
                 tl.zeros((), tl.int64))
    # usage 0 lowers a key below used slots' keys: the list no longer holds the smallest keys
    vb = tl.arange(0, V_BLOCK)
    tl.store(vkeys_ptr + vb, tl.full((V_BLOCK,), 0x7FFFFFFFFFFFFFFF, tl.int64),
             mask=vb < tl.where(installed > 0, V_BLOCK, 0))
    tl.store(num_indices_ptr, installed.to(tl.int32))


@triton.jit
def _in_routed(x, routed_ptr, num_routed, R_BLOCK: tl.constexpr):
    """Per lane of x [N] int64: whether it is one of the num_routed ids at routed_ptr."""
    ri = tl.arange(0, R_BLOCK)
    found = x * 0
    for r0 in range(0, num_routed, R_BLOCK):
        r = tl.load(routed_ptr + r0 + ri, mask=r0 + ri < num_routed, other=-2).to(tl.int64)
        found = tl.maximum(found, tl.max((x[:, None] == r[None, :]).to(tl.int64), axis=1))
    return found > 0


@triton.jit
def prefetch_score_kernel(
    routed_ptr, num_routed,     # [R] int32|int64 the layer's routed expert ids
    chosen_ptr, chosen_len,     # [>= chosen_len] int32|int64 the prefetch's choice for the layer (-1 = none)
    num_chosen_ptr,             # [1] int32: only the first this many count (HAS_NUM; else chosen_len)
    cand_ptr, num_cand,         # [num_cand] int32|int64 the predictor's candidates for the layer (TRACK)
    ranks_ptr,                  # [>= num_cand] int32|int64 each one's rank among the non-resident ones, -1 else
    k,                          # lanes scored per rank (>= num_cand; lanes past num_cand count as none)
    allow_ptr,                  # [1] int32|int64 the count auto allowed the layer (TRACK)
    counts_ptr,                 # [6] int64 prefetch.COUNTERS
    seen_ptr, hit_ptr,          # [k + 1] int64 the layer's per-rank counts, column k: resident or none (TRACK)
    R_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
    HAS_NUM: tl.constexpr, TRACK: tl.constexpr, COUNT_INSTALLED: tl.constexpr,
):
    ci = tl.arange(0, C_BLOCK)
    n = chosen_len + tl.zeros((), tl.int64)
    if HAS_NUM:
        n = tl.minimum(n, tl.load(num_chosen_ptr).to(tl.int64))
    chosen = tl.load(chosen_ptr + ci, mask=ci < n, other=-1).to(tl.int64)
    valid = chosen >= 0
    hit = _in_routed(chosen, routed_ptr, num_routed, R_BLOCK) & valid
    tl.atomic_add(counts_ptr + 0, tl.sum(valid.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(hit.to(tl.int64), axis=0))
    if COUNT_INSTALLED:
        tl.atomic_add(counts_ptr + 2, tl.sum(valid.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 3, tl.full((), 1, tl.int64))
    if TRACK:
        ki = tl.arange(0, K_BLOCK)
        cand = tl.load(cand_ptr + ki, mask=ki < num_cand, other=-1).to(tl.int64)
        rank = tl.load(ranks_ptr + ki, mask=ki < num_cand, other=-1).to(tl.int64)
        routed = _in_routed(cand, routed_ptr, num_routed, R_BLOCK) & (cand >= 0)
        col = tl.where(rank >= 0, rank, k)
        lane = ki < k
        tl.atomic_add(seen_ptr + col, tl.full((K_BLOCK,), 1, tl.int64), mask=lane)
        tl.atomic_add(hit_ptr + col, routed.to(tl.int64), mask=lane)
        pick = (rank >= 0) & (rank < tl.load(allow_ptr).to(tl.int64)) & lane
        tl.atomic_add(counts_ptr + 4, tl.sum(pick.to(tl.int64), axis=0))
        tl.atomic_add(counts_ptr + 5, tl.sum((pick & routed).to(tl.int64), axis=0))
