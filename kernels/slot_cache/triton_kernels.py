"""Triton kernels of the slot-cache contract (docs/slot_cache.md); `reference.py` is the oracle.

One program (grid (1,)) does a whole call: the work is sequential by nature (victim i+1 depends on
victim i) and small, so one block, scanning the pool in tiles of SLOT_TILE slots, keeps it to one
launch that a CUDA graph can replay.  Results do not depend on SLOT_TILE: victims are picked by a
strict total order on the packed key (usage + 1) << SLOT_BITS | slot, and the i-th victim is the
smallest key above the (i-1)-th, which equals picking one slot at a time and marking it used.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .state import OWNER_BITS, SLOT_BITS

INT64_MAX = 0x7FFFFFFFFFFFFFFF


@triton.jit
def _mix32(x):
    # 32-bit xor-shift-multiply finaliser on int64 holders of uint32 values.  Each 32x32 product is
    # split into 16-bit halves of the constant so that no intermediate overflows int64.
    x = x ^ (x >> 16)
    x = (x * 0x352D + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF    # x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF    # x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _draw16(seed, step, layer):
    h = _mix32((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _mix32(h ^ (step & 0xFFFFFFFF))
    h = _mix32(h ^ ((step >> 32) & 0xFFFFFFFF))
    h = _mix32(h ^ (layer & 0xFFFFFFFF))
    return h >> 16


@triton.jit
def _fetch_count(num_misses, num_hits, num_slots, first_key, max_fetch, frac_q16, round_mode,
                 promote, seed, step, layer):
    # (k, promoted): misses to fetch under the fixed cap or the fraction rule (fetch_rule.py),
    # recency promotion, and the cap at the slots this call does not use. first_key: the largest
    # _order_key (its low bit says whether the first miss was routed before).
    prod = frac_q16 * num_misses
    lo = prod >> 16
    hi = lo + 1
    cost_lo = tl.maximum(lo * (65536 - frac_q16), (num_misses - lo) * frac_q16)
    cost_hi = tl.maximum(hi * (65536 - frac_q16), (num_misses - hi) * frac_q16)
    k_minwait = tl.where(cost_hi < cost_lo, hi, lo)
    k_stoch = lo
    if round_mode == 1:     # the draw is a chain of ~40 dependent integer ops: only when it is used
        k_stoch = lo + (_draw16(seed, step, layer) < (prod & 0xFFFF)).to(tl.int64)
    k_ceil = (prod + 65535) >> 16
    k_frac = tl.where(round_mode == 0, k_minwait, tl.where(round_mode == 1, k_stoch,
                                                           tl.where(round_mode == 3, lo, k_ceil)))
    k_frac = tl.minimum(k_frac, num_misses)
    promoted = (promote != 0) & (k_frac == 0) & (num_misses > 0) & ((first_key & 1) == 1)
    k_frac = tl.where(promoted, 1, k_frac)
    promoted = promoted & (max_fetch < 0)
    k = tl.where(max_fetch >= 0, tl.minimum(num_misses, max_fetch), k_frac)
    k = tl.minimum(k, num_slots - num_hits)
    return k, promoted


@triton.jit
def _key_value(u, owner, count_ptr, freq_weight, ok, USE_FREQ: tl.constexpr):
    # The eviction key's value part (reference.victim_key_values): usage + 1, plus with USE_FREQ the frequency
    # weight times the owner's routes so far (capped at FREQ_COUNT_CAP = 1 << 24) for a used slot (usage >= 1).
    value = u + 1
    if USE_FREQ:
        cnt = tl.load(count_ptr + owner, mask=ok & (owner >= 0), other=0)
        value = value + tl.where(u >= 1, freq_weight * tl.minimum(cnt, 1 << 24), 0)
    return value


@triton.jit
def _age_counts(count_ptr, num_counts, step, freq_half_life):
    # SlotCache.freq_half_life: after a call whose step is a multiple of it, halve every route count (all layers).
    # The caller has a barrier after its count increments; this runs once every freq_half_life calls.
    if freq_half_life > 0:
        if step % freq_half_life == 0:
            for c0 in range(0, num_counts, 1024):
                offs = c0 + tl.arange(0, 1024)
                ok = offs < num_counts
                tl.store(count_ptr + offs, tl.load(count_ptr + offs, mask=ok, other=0) >> 1, mask=ok)


@triton.jit
def _next_victim(usage_ptr, id_of_slot_ptr, count_ptr, freq_weight, pool_base, num_slots, step, prev_key,
                 SLOT_TILE: tl.constexpr, USE_FREQ: tl.constexpr):
    # Smallest packed key above prev_key among slots of the pool not used at `step`.
    best = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)
    for t0 in range(0, num_slots, SLOT_TILE):
        offs = t0 + tl.arange(0, SLOT_TILE)                          # [SLOT_TILE] pool-local
        in_pool = offs < num_slots
        u = tl.load(usage_ptr + pool_base + offs, mask=in_pool, other=0)
        owner = tl.full((SLOT_TILE,), -1, tl.int64)
        if USE_FREQ:
            owner = tl.load(id_of_slot_ptr + pool_base + offs, mask=in_pool, other=-1).to(tl.int64)
        value = _key_value(u, owner, count_ptr, freq_weight, in_pool, USE_FREQ)
        key = (value << 25) | offs.to(tl.int64)                 # SLOT_BITS = 25
        ok = in_pool & (u != step) & (key > prev_key)
        key = tl.where(ok, key, 0x7FFFFFFFFFFFFFFF)
        best = tl.minimum(best, tl.min(key, axis=0))
    return best


@triton.jit
def _install_known(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, slot, old, flat_id, usage_value):
    # flat_id takes `slot` from its previous owner `old` (-1: the slot was empty)
    tl.store(slot_for_id_ptr + old, -1, mask=old >= 0)
    tl.store(id_of_slot_ptr + slot, flat_id.to(tl.int32))
    tl.store(slot_for_id_ptr + flat_id, slot.to(tl.int32))
    tl.store(usage_ptr + slot, usage_value)


@triton.jit
def _install(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, slot, flat_id, usage_value):
    old = tl.load(id_of_slot_ptr + slot)
    _install_known(slot_for_id_ptr, id_of_slot_ptr, usage_ptr, slot, old, flat_id, usage_value)


@triton.jit
def _order_key(e, rec, miss, select_mode, E_BLOCK: tl.constexpr):
    # Misses are fetched by descending key: recency desc then id asc (select 0), or id asc alone;
    # -1 for anything else. Bit 0 holds rec >= 0, so that one max gives both the first miss and
    # what promotion needs to know about it (no second reduction for its recency).
    id_key = E_BLOCK - 1 - e
    key = tl.where(select_mode == 0, (rec + 1) * E_BLOCK + id_key, id_key)
    return tl.where(miss, key * 2 + (rec >= 0).to(tl.int64), -1)


@triton.jit
def _miss_expert(key, E_BLOCK: tl.constexpr):
    # the (layer-local) expert of an _order_key
    return (E_BLOCK - 1) - ((key >> 1) % E_BLOCK)


@triton.jit
def _next_miss(order_key, prev_order):
    # the order key of the next miss to fetch: the largest one below prev_order
    return tl.max(tl.where(order_key < prev_order, order_key, -1), axis=0)


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
    policy_ptr,           # [6] int64 device policy (read when USE_POLICY)
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
    select_mode,          # 0 recency, 1 lowest_id
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
        select_mode = tl.load(policy_ptr + 3)
        promote = tl.load(policy_ptr + 4)
        seed = tl.load(policy_ptr + 5)
    zero = tl.zeros((), tl.int64)   # widen scalar args (int32, or constexpr when specialised)
    max_fetch = max_fetch + zero
    frac_q16 = frac_q16 + zero
    round_mode = round_mode + zero
    select_mode = select_mode + zero
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
    order_key = _order_key(ev.to(tl.int64), rec, miss, select_mode, E_BLOCK)
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
    NUM_EXPERTS: tl.constexpr,
    C_BLOCK: tl.constexpr,       # next power of two >= C
    SLOT_TILE: tl.constexpr,
    V_BLOCK: tl.constexpr,       # victim-list length (>= 1)
    USE_FREQ: tl.constexpr,
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


assert SLOT_BITS == 25  # the kernels spell the constant out (constexpr arithmetic)


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
    policy_ptr,           # [6] int64 device policy (read when USE_POLICY)
    part_keys_ptr,        # [G * CAND] int64 scratch: each program's smallest victim keys
    arrive_ptr,           # [1] int32 scratch: programs done with their part (reset to 0 at exit)
    vkeys_ptr,            # [V] int64 this pool's victim list: ascending keys, KEY_NONE = none
    vowner_ptr,           # [V] int32 owners of those slots when the list was built
    count_ptr,            # [L*E] int64 routes seen per expert (read and counted when USE_FREQ)
    freq_weight,          # W of the frequency-weighted key (USE_FREQ)
    freq_half_life,       # halve every count after a call whose step is a multiple of this (0: never; USE_FREQ)
    num_counts,           # L*E
    layer, pool_base, num_slots, max_fetch, frac_q16, round_mode, select_mode, promote, seed,
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
        select_mode = tl.load(policy_ptr + 3)
        promote = tl.load(policy_ptr + 4)
        seed = tl.load(policy_ptr + 5)
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
    order_key = _order_key(e64, rec, miss, select_mode, E_BLOCK)
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
