"""The decode-sized ensure kernel of the slot cache (calls of at most SMALL_ROUTES_MAX routes): per-route
work, the pool scan split over programs, and the pool's victim list (see ensure_small_kernel).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.slot_cache.state import OWNER_BITS, SLOT_BITS
from ftexpert.kernels.slot_cache.triton_common import _age_counts, _fetch_count, _install_known, _key_value, _miss_expert, _next_miss, _order_key

# A victim candidate packed into one int64, so that one min picks the next victim and its owner:
# bits 56-62 the candidate's index in its ascending list (list order = key order), bits 30-54 the
# pool-local slot, bits 0-29 the owner + 1 (0: an empty slot). KEY_NONE: no candidate.
PACK_INDEX_SHIFT = 56
PACK_SLOT_SHIFT = 30
PACK_OWNER_MASK = (1 << 30) - 1
assert PACK_SLOT_SHIFT + SLOT_BITS <= PACK_INDEX_SHIFT and PACK_OWNER_MASK == (1 << OWNER_BITS) - 1


@triton.jit
def _pack_victims(index, slot, owner, ok):
    # [N] candidates in ascending key order -> packed (KEY_NONE where not ok)
    packed = (index.to(tl.int64) << 56) | (slot.to(tl.int64) << 30) | (owner.to(tl.int64) + 1)
    return tl.where(ok, packed, 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _sum_max(a1, b1, a2, b2):
    return a1 + a2, tl.maximum(b1, b2)


@triton.jit
def _sum_min(a1, b1, a2, b2):
    return a1 + a2, tl.minimum(b1, b2)


@triton.jit
def _install_misses(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, evict_ptr, src_ptr, packed, first_packed,
                    order_key, first_key, k, row, step, pool_base, promoted, e64, out,
                    E_BLOCK: tl.constexpr):
    # The decode kernel's installs: the i-th miss in order takes the slot of the i-th smallest of
    # `packed` (_pack_victims), unless a promotion finds no empty slot; routes of the expert point at
    # the slot. Returns (out, installed). The first miss and the first victim (first_key,
    # first_packed) are already reduced by the caller, so the usual k = 1 costs no reduction here.
    installed = tl.zeros((), tl.int32)
    cur = first_key
    pk = first_packed
    for i in range(0, k):
        if i > 0:
            cur = _next_miss(order_key, cur)
            pk = tl.min(tl.where(packed > pk, packed, 0x7FFFFFFFFFFFFFFF), axis=0)
        expert = _miss_expert(cur, E_BLOCK)
        victim = pool_base + ((pk >> 30) & ((1 << 25) - 1))
        old = (pk & ((1 << 30) - 1)) - 1
        if (promoted == 0) | (old < 0):
            _install_known(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, victim, old, row + expert, step)
            tl.store(evict_ptr + i, victim.to(tl.int32))
            tl.store(src_ptr + i, expert.to(tl.int32))
            out = tl.where(e64 == expert, victim, out)
            installed += 1
    return out, installed


@triton.jit
def ensure_small_kernel(
    ids_ptr,              # [N] int32|int64 routed expert ids (-1 = padding), rewritten in place
    num_routes,           # N <= ROUTE_BLOCK
    slot_for_id_ptr,      # [L*E] int32
    id_of_slot_ptr,       # [P*S] int32
    usage_ptr,            # [P*S] int64
    step_ptr,             # [1] int64
    recency_ptr,          # [L*E] int64
    mark_ptr,             # [E] int64 scratch (kept equal to the reference's)
    evict_ptr,            # [S] int32 copy plan: destination slots
    src_ptr,              # [S] int32 copy plan: layer-local expert rows
    num_indices_ptr,      # [1] int32
    num_missing_ptr,      # [1] int32
    error_ptr,            # [1] int32 error bits
    policy_ptr,           # [5] int64 device policy (read when USE_POLICY)
    part_keys_ptr,        # [G * CAND] int64 scratch: each program's smallest victim keys
    arrive_ptr,           # [1] int32 scratch: programs done with their part (reset to 0 at exit)
    vkeys_ptr,            # [V] int64 this pool's victim list: ascending keys, KEY_NONE = none
    vowner_ptr,           # [V] int32 owners of those slots when the list was built
    count_ptr,            # [L*E] int64 routes seen per expert (read and counted when USE_FREQ)
    freq_weight,          # W of the frequency-weighted key (USE_FREQ)
    freq_half_life,       # halve every count after a call whose step is a multiple of this (0: never; USE_FREQ)
    num_counts,           # L*E
    layer, pool_base, num_slots, max_fetch, frac_q16, round_mode, promote, seed,
    NUM_EXPERTS: tl.constexpr,   # E
    E_BLOCK: tl.constexpr,       # next power of two >= E (order-key radix)
    ROUTE_BLOCK: tl.constexpr,   # power of two >= N
    PART: tl.constexpr,          # slots scanned by each program
    V: tl.constexpr,             # victim-list length (power of two; 0 = no list)
    CAND: tl.constexpr,          # power of two >= ROUTE_BLOCK + V: candidates kept per program (<= 128)
    MERGE_BLOCK: tl.constexpr,   # power of two >= G * CAND
    USE_POLICY: tl.constexpr,    # read the policy scalars from policy_ptr
    MULTI: tl.constexpr,         # more than one program (G > 1)
    USE_FREQ: tl.constexpr,      # the frequency-weighted key (freq_weight > 0; launched with V = 0: see api.ensure)
):
    """Decode-sized calls (N <= ROUTE_BLOCK routes): per-route work, victims from a list or a scan.

    Every program analyses the routes itself (hits, misses and k need no communication).
    Fast path: the pool's victim list holds the V smallest keys as of the call that built it. An
    entry is live while its slot's usage is unchanged; keys only grow between builds, so the live
    entries are still the pool's smallest keys, and when at least k of them are not hits of this
    call, they are the victims: no scan. Slow path: every program marks the hits used, scans its
    PART slots for its k + V smallest keys and writes them to scratch; the applier merges them,
    takes the first k as victims and the next V as the new list. With several programs the last to
    arrive applies the call (no program may rewrite routes or maps another has yet to read).
    """
    tl.static_assert(CAND <= 128)     # a candidate's index fits the packed victim's 7 index bits
    pid = tl.program_id(0)
    zero = tl.zeros((), tl.int64)
    if USE_POLICY:
        max_fetch = tl.load(policy_ptr + 0)
        frac_q16 = tl.load(policy_ptr + 1)
        round_mode = tl.load(policy_ptr + 2)
        promote = tl.load(policy_ptr + 3)
        seed = tl.load(policy_ptr + 4)
    max_fetch = max_fetch + zero
    frac_q16 = frac_q16 + zero
    layer = layer + zero
    freq_weight = freq_weight + zero
    freq_half_life = freq_half_life + zero
    step = tl.load(step_ptr) + 1
    row = layer * NUM_EXPERTS

    # routes: distinct experts are the first occurrence of each id. Every load that does not depend on
    # another is issued before the first reduction (its barrier would hold the loads back).
    r = tl.arange(0, ROUTE_BLOCK)                                         # [R]
    in_r = r < num_routes
    e = tl.load(ids_ptr + r, mask=in_r, other=-1)
    e64 = e.to(tl.int64)
    valid = in_r & (e64 >= 0) & (e64 < NUM_EXPERTS)
    slot = tl.load(slot_for_id_ptr + row + e64, mask=valid, other=-1).to(tl.int64)
    rec = tl.load(recency_ptr + row + e64, mask=valid, other=-1)
    if V > 0:
        vj = tl.arange(0, V)                                              # [V] the victim list
        vkey = tl.load(vkeys_ptr + vj)
        vown = tl.load(vowner_ptr + vj)
        vslot = vkey & ((1 << 25) - 1)
        vused = vkey != 0x7FFFFFFFFFFFFFFF
        vu = tl.load(usage_ptr + pool_base + vslot, mask=vused, other=0)
        vval = _key_value(vu, vown.to(tl.int64), count_ptr, freq_weight, vused, USE_FREQ)
    same = (e64[:, None] == e64[None, :]) & (r[None, :] < r[:, None]) & valid[None, :]
    distinct = valid & (tl.max(same.to(tl.int32), axis=1) == 0)
    if V > 0:
        # An entry is live while its slot's usage is unchanged, and then its owner is the recorded one:
        # an entry whose owner is routed now is a hit of this call (duplicates included; this waits for
        # neither `distinct` nor the slot lookups).
        routed_flat = tl.where(valid, row + e64, -2)                      # [R]
        vhit = tl.max((vown[:, None].to(tl.int64) == routed_flat[None, :]).to(tl.int32), axis=1) > 0
    hit = distinct & (slot >= 0)
    miss = distinct & (slot < 0)
    bad = in_r & ((e64 < -1) | (e64 >= NUM_EXPERTS))
    order_key = _order_key(e64, rec, miss, E_BLOCK)
    # hits, misses and bad ids counted by one sum, in 8-bit fields (R <= 64); the same reduction gives
    # the first miss (the largest order key)
    tl.static_assert(ROUTE_BLOCK < 256)
    counts, first_key = tl.reduce(
        (hit.to(tl.int32) | (miss.to(tl.int32) << 8) | (bad.to(tl.int32) << 16), order_key), 0, _sum_max)
    if V > 0:
        live = vused & (((vval << 25) | vslot) == vkey) & (vhit == 0)
        vpacked = _pack_victims(vj, vslot, vown, live)
        # how many live entries, and the smallest (the first victim), in one reduction
        num_live, first_v = tl.reduce((live.to(tl.int32), vpacked), 0, _sum_min)
    else:                                   # no list: the fast path below never runs
        vpacked = tl.full((1,), 0x7FFFFFFFFFFFFFFF, tl.int64)
        first_v = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)
        num_live = counts * 0
    num_hits = (counts & 255).to(tl.int64)
    num_misses = ((counts >> 8) & 255).to(tl.int64)

    k, promoted = _fetch_count(num_misses, num_hits, num_slots, first_key, max_fetch, frac_q16,
                               round_mode, promote, seed + zero, step, layer)
    fast = (k == 0) | (num_live >= k)      # victims from the list: no scan

    cj = tl.arange(0, CAND)
    cands = tl.full((CAND,), 0x7FFFFFFFFFFFFFFF, tl.int64)
    if fast == 0:
        # every program marks the hits itself, so that its own part sees them as used
        tl.store(usage_ptr + slot, step, mask=hit)
        tl.debug_barrier()
        part = pid * PART + tl.arange(0, PART)                            # [PART] pool-local
        in_part = part < num_slots
        u = tl.load(usage_ptr + pool_base + part, mask=in_part, other=0)
        owner = tl.full((PART,), -1, tl.int64)
        if USE_FREQ:
            owner = tl.load(id_of_slot_ptr + pool_base + part, mask=in_part, other=-1).to(tl.int64)
        value = _key_value(u, owner, count_ptr, freq_weight, in_part, USE_FREQ)
        key = tl.where(in_part & (u != step), (value << 25) | part.to(tl.int64),
                       0x7FFFFFFFFFFFFFFF)
        prev = tl.full((), -1, tl.int64)
        for j in range(0, k + V):
            best = tl.min(tl.where(key > prev, key, 0x7FFFFFFFFFFFFFFF), axis=0)
            cands = tl.where(cj == j, best, cands)
            prev = best
        if MULTI:
            tl.store(part_keys_ptr + pid * CAND + cj, cands)
    if MULTI:
        tl.debug_barrier()
        arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel")
        applies = arrived == tl.num_programs(0) - 1
    else:
        applies = pid == 0

    if applies:
        tl.store(usage_ptr + slot, step, mask=hit)
        out = tl.where(valid, slot, -1)                                   # [R]
        installed = tl.zeros((), tl.int32)
        if k > 0:
            if fast:
                # victims: the k smallest live list entries; owners as recorded in the list
                out, installed = _install_misses(
                    slot_for_id_ptr, id_of_slot_ptr, usage_ptr, evict_ptr, src_ptr, vpacked, first_v,
                    order_key, first_key, k, row, step, pool_base, promoted, e64, out, E_BLOCK)
            else:
                if MULTI:
                    m = tl.arange(0, MERGE_BLOCK)                         # [G*CAND] candidates
                    m_ok = ((m // CAND) < tl.num_programs(0)) & ((m % CAND) < k + V)
                    pool_c = tl.load(part_keys_ptr + m, mask=m_ok, other=0x7FFFFFFFFFFFFFFF,
                                     volatile=True)
                    sel = tl.full((CAND,), 0x7FFFFFFFFFFFFFFF, tl.int64)
                    prev = tl.full((), -1, tl.int64)
                    for j in range(0, k + V):
                        best = tl.min(tl.where(pool_c > prev, pool_c, 0x7FFFFFFFFFFFFFFF), axis=0)
                        sel = tl.where(cj == j, best, sel)
                        prev = best
                else:
                    sel = cands                                           # already merged
                sel_used = sel != 0x7FFFFFFFFFFFFFFF
                sel_slot = sel & ((1 << 25) - 1)
                sel_own = tl.load(id_of_slot_ptr + pool_base + sel_slot, mask=sel_used, other=-1)
                # sel ascends: its i-th smallest key is entry i (the k victims precede the list)
                sel_packed = _pack_victims(cj, sel_slot, sel_own, sel_used)
                out, installed = _install_misses(
                    slot_for_id_ptr, id_of_slot_ptr, usage_ptr, evict_ptr, src_ptr, sel_packed,
                    tl.min(sel_packed, axis=0), order_key, first_key, k, row, step, pool_base, promoted,
                    e64, out, E_BLOCK)
                if V > 0:
                    # the new list: the V keys after the installed victims (untouched by this call)
                    dst = cj - installed
                    keep = (dst >= 0) & (dst < V)
                    tl.store(vkeys_ptr + dst, sel, mask=keep)
                    tl.store(vowner_ptr + dst, sel_own, mask=keep)
        if MULTI:
            tl.store(arrive_ptr, 0)
        if (counts >> 16) > 0:
            # behind a uniform branch: a scalar atomic brings two block barriers, paid only on error
            tl.atomic_or(error_ptr, 1)
        tl.store(num_indices_ptr, installed)
        tl.store(num_missing_ptr, num_misses.to(tl.int32))
        tl.store(mark_ptr + e64, step, mask=valid)
        tl.store(recency_ptr + row + e64, step, mask=valid)
        if USE_FREQ:     # after every key of this call is read (a routed expert's key does not matter here)
            tl.atomic_add(count_ptr + row + e64, 1, mask=valid)
            tl.debug_barrier()
            _age_counts(count_ptr, num_counts, step, freq_half_life)
        tl.debug_barrier()   # every thread has read its routes before any is rewritten
        tl.store(ids_ptr + r, out.to(e.dtype), mask=in_r)
        tl.store(step_ptr, step)
