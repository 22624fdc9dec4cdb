"""Device functions shared by the slot-cache kernels (triton_kernels.py, triton_decode.py): the fetch-count rule
(fetch_rule.py, bit for bit), the eviction key, the victim scan, installs and the miss order.

The kernels spell SLOT_BITS out as 25 (constexpr arithmetic); the assert below keeps them honest.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ftexpert.kernels.slot_cache.state import SLOT_BITS

assert SLOT_BITS == 25


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
    rest = prod & 0xFFFF            # within M units of a whole count: that count (fetch_rule.snapped_product)
    prod = tl.where(rest <= num_misses, prod - rest, tl.where(rest >= 65536 - num_misses, prod - rest + 65536, prod))
    lo = prod >> 16
    hi = lo + 1
    cost_lo = tl.maximum(lo * (65536 - frac_q16), (num_misses - lo) * frac_q16)
    cost_hi = tl.maximum(hi * (65536 - frac_q16), (num_misses - hi) * frac_q16)
    k_minwait = tl.where(cost_hi < cost_lo - num_misses, hi, lo)
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
def _order_key(e, rec, miss, E_BLOCK: tl.constexpr):
    # Misses are fetched by descending key: recency desc then id asc; -1 for anything else. Bit 0
    # holds rec >= 0, so that one max gives both the first miss and what promotion needs to know
    # about it (no second reduction for its recency).
    key = (rec + 1) * E_BLOCK + (E_BLOCK - 1 - e)
    return tl.where(miss, key * 2 + (rec >= 0).to(tl.int64), -1)


@triton.jit
def _miss_expert(key, E_BLOCK: tl.constexpr):
    # the (layer-local) expert of an _order_key
    return (E_BLOCK - 1) - ((key >> 1) % E_BLOCK)


@triton.jit
def _next_miss(order_key, prev_order):
    # the order key of the next miss to fetch: the largest one below prev_order
    return tl.max(tl.where(order_key < prev_order, order_key, -1), axis=0)
