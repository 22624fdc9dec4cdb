"""The fetch count k, stated by hand: `fetch_rule.fetch_count` per rounding mode over a grid of M and f, the
stochastic mode's draws, the recency promotion and the caps through `ensure` (reference and both Triton kernels).

The other slot-cache tests compare the kernels with the reference; these compare both with literal tables written
from the contract (docs/slot_cache.md), so a wrong rule in fetch_rule.py fails here even where kernel and reference
still agree. The tables hold the rule on the exact f: f travels in Q16 (round(f * 65536)), and the code takes a
product within the encoding's error of a whole count as that count, so no cell may differ from the exact-rational
rule; `test_tables_are_the_exact_rule` checks the tables against a Fraction transcription of the rule (never
against fetch_rule.py or reference.py).
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from ftexpert.kernels.slot_cache import SlotCache, ensure
from ftexpert.kernels.slot_cache.fetch_rule import draw16, fetch_count, fraction_to_q16
from ftexpert.kernels.slot_cache.state import ROUND_MODES
from tests.conftest import KERNEL_DEVICE
from tests.kernels.slot_cache_util import assert_same_state

MS = (0, 1, 2, 3, 4, 5, 7, 8, 10, 16)
FS = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)

# f -> round(f * 65536): 0.1 and 0.6 round up, 0.4 and 0.9 round down; the others are exact
Q16 = {0.0: 0, 0.1: 6554, 0.25: 16384, 0.4: 26214, 0.5: 32768, 0.6: 39322, 0.75: 49152, 0.9: 58982, 1.0: 65536}

# Expected k per f, one entry per M of MS (0, 1, 2, 3, 4, 5, 7, 8, 10, 16).
# min-wait: of floor(fM) and floor(fM) + 1 the one with the smaller max(k(1-f), (M-k)f), ties to floor; that is
# floor + 1 exactly when frac(fM) > 1 - f.
MIN_WAIT = {
    0.0: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    0.1: [0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    0.25: [0, 0, 0, 0, 1, 1, 1, 2, 2, 4],    # M=3 (0.75) and M=7 (1.75) are ties: floor
    0.4: [0, 0, 1, 1, 1, 2, 3, 3, 4, 6],     # M=4 (1.6) a tie: floor
    0.5: [0, 0, 1, 1, 2, 2, 3, 4, 5, 8],     # odd M: ties, floor
    0.6: [0, 1, 1, 2, 2, 3, 4, 5, 6, 10],    # M=4 (2.4) a tie: floor, though f_q16 is a hair above 0.6
    0.75: [0, 1, 2, 2, 3, 4, 5, 6, 8, 12],   # M=3 (2.25) and M=7 (5.25) are ties: floor
    0.9: [0, 1, 2, 3, 4, 5, 7, 8, 9, 15],
    1.0: [0, 1, 2, 3, 4, 5, 7, 8, 10, 16],
}
# prefer-fetch: ceil(fM)
PREFER_FETCH = {
    0.0: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    0.1: [0, 1, 1, 1, 1, 1, 1, 1, 1, 2],     # M=10: 1, though 10 * 6554 is just above 65536
    0.25: [0, 1, 1, 1, 1, 2, 2, 2, 3, 4],
    0.4: [0, 1, 1, 2, 2, 2, 3, 4, 4, 7],
    0.5: [0, 1, 1, 2, 2, 3, 4, 4, 5, 8],
    0.6: [0, 1, 2, 2, 3, 3, 5, 5, 6, 10],    # M=5: 3 and M=10: 6, though f_q16 * M is just above
    0.75: [0, 1, 2, 3, 3, 4, 6, 6, 8, 12],
    0.9: [0, 1, 2, 3, 4, 5, 7, 8, 9, 15],
    1.0: [0, 1, 2, 3, 4, 5, 7, 8, 10, 16],
}
# floor(fM): the split mode, and the stochastic mode before its +1
FLOOR = {
    0.0: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    0.1: [0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    0.25: [0, 0, 0, 0, 1, 1, 1, 2, 2, 4],
    0.4: [0, 0, 0, 1, 1, 2, 2, 3, 4, 6],     # M=5: 2 and M=10: 4, though f_q16 * M is just below
    0.5: [0, 0, 1, 1, 2, 2, 3, 4, 5, 8],
    0.6: [0, 0, 1, 1, 2, 3, 4, 4, 6, 9],
    0.75: [0, 0, 1, 2, 3, 3, 5, 6, 7, 12],
    0.9: [0, 0, 1, 2, 3, 4, 6, 7, 9, 14],    # M=10: 9, though f_q16 * M is just below
    1.0: [0, 1, 2, 3, 4, 5, 7, 8, 10, 16],
}
TABLES = {"min-wait": MIN_WAIT, "prefer-fetch": PREFER_FETCH, "split": FLOOR}



def cells(modes):
    return [pytest.param(mode, m, f, id=f"{mode}-M{m}-f{f}") for mode in modes for f in FS for m in MS]


def exact_rule(mode: str, m: int, f: Fraction) -> int:
    """The contract's rule in exact rational arithmetic (a transcription for the tables' cross-check)."""
    lo = math.floor(f * m)
    if mode == "min-wait":
        def cost(k):
            return max(k * (1 - f), (m - k) * f)
        k = lo + 1 if cost(lo + 1) < cost(lo) else lo
    elif mode == "prefer-fetch":
        k = math.ceil(f * m)
    else:
        k = lo
    return min(k, m)


def test_round_mode_codes_and_q16():
    """The codes the kernels take, and the grid's fractions in Q16."""
    assert ROUND_MODES == {"min-wait": 0, "stochastic": 1, "prefer-fetch": 2, "split": 3}
    assert {f: fraction_to_q16(f) for f in FS} == Q16


def test_tables_are_the_exact_rule():
    """Every hand value equals the rule on the exact rational f (a check of the tables, not of the code)."""
    for mode, table in TABLES.items():
        for f in FS:
            for m, want in zip(MS, table[f]):
                assert exact_rule(mode, m, Fraction(str(f))) == want, (mode, m, f)


def test_q16_alone_would_miss_the_whole_counts():
    """The cells where the raw Q16 product lies on the wrong side of a whole count (so the snap to it is what makes
    the tables hold): the rule on f_q16 / 65536 without the snap gives another count there."""
    off = {(mode, m, f) for mode, table in TABLES.items() for f in FS for m, want in zip(MS, table[f])
           if exact_rule(mode, m, Fraction(Q16[f], 1 << 16)) != want}
    assert off == {("min-wait", 4, 0.6), ("prefer-fetch", 10, 0.1), ("prefer-fetch", 5, 0.6),
                   ("prefer-fetch", 10, 0.6), ("split", 5, 0.4), ("split", 10, 0.4), ("split", 10, 0.9)}


@pytest.mark.parametrize("mode, m, f", cells(TABLES))
def test_fetch_count_table(mode, m, f):
    """fetch_count against the hand table; the deterministic modes ignore seed, step and layer."""
    want = TABLES[mode][f][MS.index(m)]
    for seed, step, layer in ((0, 1, 0), (3, 7, 1), (12345, 2 ** 33 + 1, 5)):
        assert fetch_count(m, Q16[f], ROUND_MODES[mode], seed=seed, step=step, layer=layer) == want


# ---- stochastic -----------------------------------------------------------------------------------------------

# draw16(seed, step, layer) pinned: the draw is part of the contract (reproducible across replays and versions, the
# same in kernel and reference), and the ensure cases below rely on these values
DRAW16 = {(0, 1, 0): 5113, (0, 1, 1): 32984, (0, 2, 0): 55025, (0, 3, 0): 18887, (3, 3, 0): 46198,
          (0, 2 ** 32 + 5, 0): 29811, (2 ** 40 + 7, 9, 2): 53873, (7, 1, 3): 174}
DRAWS = [(seed, step) for seed in range(80) for step in range(1, 51)]   # 4000 (seed, step) pairs, layer 0
TOL = 0.04   # on the +1 frequency over 4000 draws: its standard deviation is at most 0.008, so 5 sigma
# f*M is an integer but f_q16*M is not: draws that fall between f_q16*M and the whole count, so without the snap to
# it they would give the other count. (M, f, seed, step) with layer 0, and the draw.
Q16_STOCHASTIC = [
    (5, 0.4, 17, 1525, 65534),    # f_q16*M = 2 - 2/65536: the draw 65534 would give 1
    (5, 0.4, 21, 462, 65535),
    (10, 0.4, 33, 1801, 65532),   # 4 - 4/65536: would give 3
    (10, 0.9, 33, 1801, 65532),   # 9 - 4/65536: would give 8
    (10, 0.1, 4, 210, 3),         # 1 + 4/65536: the draw 3 would give 2
    (10, 0.6, 4, 210, 3),         # 6 + 4/65536: would give 7
    (5, 0.6, 20, 282, 1),         # 3 + 2/65536: would give 4
]


def test_draw16_is_pinned():
    assert {key: draw16(*key) for key in DRAW16} == DRAW16


@pytest.mark.parametrize("mode, m, f", cells(["stochastic"]))
def test_stochastic_floor_or_floor_plus_one(mode, m, f):
    """Each draw gives floor(fM) or floor(fM) + 1, the same again for the same (seed, step, layer); the +1 comes
    with frequency frac(fM) (of the exact f); integral fM gives fM every time."""
    lo = FLOOR[f][MS.index(m)]
    ks = [fetch_count(m, Q16[f], ROUND_MODES[mode], seed=seed, step=step, layer=0) for seed, step in DRAWS]
    assert set(ks) <= {lo, lo + 1}
    assert ks[:50] == [fetch_count(m, Q16[f], ROUND_MODES[mode], seed=seed, step=step, layer=0)
                       for seed, step in DRAWS[:50]]
    exact = Fraction(str(f)) * m
    if exact.denominator == 1:
        assert ks == [int(exact)] * len(DRAWS)
    freq = ks.count(lo + 1) / len(ks)
    assert abs(freq - float(exact - lo)) <= TOL, f"+1 in {freq:.4f} of draws, frac(fM) = {float(exact - lo):.4f}"


@pytest.mark.parametrize("m, f, seed, step, draw", [pytest.param(*c, id=f"stochastic-M{c[0]}-f{c[1]}-s{c[2]}")
                                                    for c in Q16_STOCHASTIC])
def test_stochastic_whole_count_despite_q16(m, f, seed, step, draw):
    """Where f*M is a whole count but f_q16*M is not, the draws between them still give the whole count."""
    assert draw16(seed, step, 0) == draw
    assert fetch_count(m, Q16[f], ROUND_MODES["stochastic"], seed=seed, step=step, layer=0) == int(Fraction(str(f)) * m)


# ---- through ensure: promotion and caps ---------------------------------------------------------------------

# Two layers, 16 experts, one global pool of 6 slots. The measured call is the cache's third (step 3), on layer 0,
# routing misses 0..M-1 (and, in "hits-N" pools, N resident experts from HIT_BASE on).
NUM_LAYERS, NUM_EXPERTS, NUM_SLOTS, HIT_BASE = 2, 16, 6, 10
IMPLS = {"reference": ("reference", "auto"), "triton-small": ("triton", "small"),
         "triton-general": ("triton", "general")}


def hit_count(pool: str) -> int:
    return int(pool[5:]) if pool.startswith("hits-") else 0


def routes(ids) -> torch.Tensor:
    return torch.tensor([list(ids) or [-1]], dtype=torch.int64)


def setup_cache(pool: str, routed: bool, m: int) -> SlotCache:
    """A reference cache after two calls. Call 1 (pool): "empty" nothing, "full" every slot takes a layer-1 expert,
    "hits-N" N slots take layer-0 experts HIT_BASE.. (routed again in the measured call). Call 2: with `routed`,
    the misses are routed once with max_fetch=0 (recency >= 0, still not resident)."""
    cache = SlotCache.create(NUM_LAYERS, NUM_EXPERTS, NUM_SLOTS)
    if pool == "full":
        ensure(cache, 1, routes(range(NUM_SLOTS)), max_fetch=NUM_SLOTS, impl="reference")
    elif pool.startswith("hits-"):
        hits = hit_count(pool)
        ensure(cache, 0, routes(range(HIT_BASE, HIT_BASE + hits)), max_fetch=hits, impl="reference")
    else:
        ensure(cache, 1, routes([]), max_fetch=0, impl="reference")
    ensure(cache, 0 if routed else 1, routes(range(m) if routed else []), max_fetch=0, impl="reference")
    # the set-up is what the case names say: misses not resident, routed before or not, the pool's empty slots
    assert int(cache.step) == 2
    assert bool((cache.slot_for_id[0, :m] == -1).all())
    assert bool((cache.expert_recency[0, :m] >= 0).all() if routed else (cache.expert_recency[0, :m] == -1).all())
    empty = 0 if pool == "full" else NUM_SLOTS - hit_count(pool)
    assert int((cache.usage == -1).sum()) == empty
    return cache


def run_case(impl_name: str, m: int, pool: str, routed: bool, policy: dict) -> tuple[SlotCache, torch.Tensor]:
    """Set up, run the measured call (step 3) with `impl_name`; return its cache and routes. A kernel's routes and
    state must also equal the reference's."""
    hits = hit_count(pool)
    ids = routes(list(range(m)) + list(range(HIT_BASE, HIT_BASE + hits)))
    ref = setup_cache(pool, routed, m)
    ker = ref.clone().to(KERNEL_DEVICE)
    ref_ids = ids.clone()
    ensure(ref, 0, ref_ids, impl="reference", **policy)
    if impl_name == "reference":
        return ref, ref_ids
    impl, path = IMPLS[impl_name]
    ker_ids = ids.clone().to(KERNEL_DEVICE)
    ensure(ker, 0, ker_ids, impl=impl, path=path, **policy)
    assert torch.equal(ker_ids.cpu(), ref_ids)
    assert_same_state(ref, ker, impl_name)
    return ker, ker_ids.cpu()


def check_fetched(cache: SlotCache, out: torch.Tensor, m: int, pool: str, want: int) -> None:
    hits = hit_count(pool)
    assert int(cache.num_indices) == want, f"copy plan has {int(cache.num_indices)} entries, expected {want}"
    assert int(cache.num_missing_full) == m
    assert int((out[0, :m] >= 0).sum()) == want          # the fetched misses now route to a slot
    assert bool((out[0, m:m + hits] >= 0).all())          # hits stay resident


def case(mode, m, f, want, *, pool="empty", routed=True, promote=True, seed=0):
    tag = f"{mode}-s{seed}" if mode == "stochastic" else mode
    name = f"{tag}-M{m}-f{f}-{pool}-{'routed' if routed else 'fresh'}-{'promote' if promote else 'nopromote'}"
    return pytest.param(mode, m, f, seed, pool, routed, promote, want, id=name)


# (mode, M, f, expected fetches): with empty slots and misses routed before, promotion on / off
PROMOTION_CASES = [
    case("min-wait", 1, 0.4, 1), case("min-wait", 1, 0.4, 0, promote=False),   # 0 by min-wait, promoted to 1
    case("min-wait", 3, 0.25, 1), case("min-wait", 3, 0.25, 0, promote=False),  # the tie at 0.75 gives 0
    case("min-wait", 3, 0.5, 1), case("min-wait", 3, 0.5, 1, promote=False),
    case("min-wait", 4, 0.25, 1), case("min-wait", 4, 0.25, 1, promote=False),
    case("min-wait", 5, 0.9, 5), case("min-wait", 5, 0.9, 5, promote=False),
    case("default", 3, 0.5, 1), case("default", 5, 0.9, 5),                    # round_mode left out: min-wait
    case("prefer-fetch", 1, 0.0, 1), case("prefer-fetch", 1, 0.0, 0, promote=False),   # f = 0, promoted
    case("prefer-fetch", 1, 0.4, 1), case("prefer-fetch", 1, 0.4, 1, promote=False),
    case("prefer-fetch", 3, 0.5, 2), case("prefer-fetch", 3, 0.5, 2, promote=False),
    case("prefer-fetch", 4, 0.25, 1), case("prefer-fetch", 4, 0.25, 1, promote=False),
    case("prefer-fetch", 5, 0.9, 5), case("prefer-fetch", 5, 0.9, 5, promote=False),
    # seed 3: draw16(3, 3, 0) = 46198, above frac(fM) for these cells: no +1
    case("stochastic", 1, 0.4, 1, seed=3), case("stochastic", 1, 0.4, 0, seed=3, promote=False),
    case("stochastic", 3, 0.5, 1, seed=3), case("stochastic", 3, 0.5, 1, seed=3, promote=False),
    case("stochastic", 4, 0.25, 1, seed=3), case("stochastic", 4, 0.25, 1, seed=3, promote=False),
    case("stochastic", 5, 0.9, 4, seed=3), case("stochastic", 5, 0.9, 4, seed=3, promote=False),
    # seed 0: draw16(0, 3, 0) = 18887, below frac(fM) (0.4 = 26214, 0.5 = 32768, 0.5 - 2^-16 = 32766): +1
    case("stochastic", 1, 0.4, 1, seed=0, promote=False), case("stochastic", 3, 0.5, 2, seed=0),
    case("stochastic", 5, 0.9, 5, seed=0),
    case("split", 1, 0.4, 1), case("split", 1, 0.4, 0, promote=False),
    case("split", 3, 0.5, 1), case("split", 4, 0.25, 1), case("split", 5, 0.9, 4),
    # no empty slot (every slot holds a layer-1 expert): no promotion, but the rule's own count evicts
    case("min-wait", 1, 0.4, 0, pool="full"), case("stochastic", 1, 0.4, 0, pool="full", seed=3),
    case("split", 1, 0.4, 0, pool="full"), case("prefer-fetch", 1, 0.0, 0, pool="full"),
    case("min-wait", 3, 0.5, 1, pool="full"), case("prefer-fetch", 3, 0.5, 2, pool="full"),
    case("min-wait", 5, 0.9, 5, pool="full"),
    # the misses never routed before (recency -1): no promotion
    case("min-wait", 1, 0.4, 0, routed=False), case("min-wait", 3, 0.25, 0, routed=False),
    case("stochastic", 1, 0.4, 0, routed=False, seed=3), case("split", 1, 0.4, 0, routed=False),
    case("prefer-fetch", 1, 0.0, 0, routed=False),
    # k never exceeds the slots this call does not use (6 - hits)
    case("min-wait", 5, 0.9, 2, pool="hits-4"), case("prefer-fetch", 3, 0.75, 2, pool="hits-4"),
    case("stochastic", 5, 0.9, 2, pool="hits-4", seed=0), case("split", 5, 0.9, 2, pool="hits-4"),
    case("min-wait", 2, 0.5, 1, pool="hits-4"),                                 # under the cap: the rule's 1
    case("min-wait", 1, 0.4, 1, pool="hits-5"),                                 # promotion into the last empty slot
    case("min-wait", 1, 0.4, 0, pool="hits-6"),                                 # promoted to 1, capped to 0
    case("prefer-fetch", 3, 0.5, 0, pool="hits-6"),
]


@pytest.mark.parametrize("impl_name", list(IMPLS))
@pytest.mark.parametrize("mode, m, f, seed, pool, routed, promote, want", PROMOTION_CASES)
def test_fraction_rule_promotion_and_cap_through_ensure(impl_name, mode, m, f, seed, pool, routed, promote, want):
    """The copy plan's length for the fraction rule, with recency promotion and the free-slot cap."""
    policy = dict(fetch_fraction=f, promote=promote, seed=seed)
    if mode != "default":
        policy["round_mode"] = mode
    cache, out = run_case(impl_name, m, pool, routed, policy)
    check_fetched(cache, out, m, pool, want)


def cap_case(m, max_fetch, want, pool="empty", **extra):
    name = f"cap{max_fetch}-M{m}-{pool}"
    if extra:   # a fraction policy beside the cap
        name += f"-{extra.get('round_mode', 'min-wait')}-f{extra['fetch_fraction']}"
    return pytest.param(m, max_fetch, pool, extra, want, id=name)


# fixed cap: k = min(M, max_fetch); misses routed before and slots empty, yet no promotion
CAP_CASES = [
    cap_case(0, 0, 0), cap_case(0, 2, 0),
    cap_case(1, 0, 0), cap_case(1, 1, 1), cap_case(1, 2, 1),
    cap_case(3, 0, 0), cap_case(3, 1, 1), cap_case(3, 2, 2), cap_case(3, 3, 3), cap_case(3, 5, 3),
    cap_case(5, 2, 2), cap_case(5, 5, 5), cap_case(5, 6, 5),
    cap_case(3, 2, 2, pool="full"),                          # evicts
    cap_case(5, 5, 2, pool="hits-4"), cap_case(5, 1, 1, pool="hits-4"),   # and the free-slot cap
    cap_case(3, 1, 1, fetch_fraction=0.9),                   # max_fetch given: the fraction is not used
    cap_case(3, 0, 0, round_mode="prefer-fetch", fetch_fraction=0.5),
]


@pytest.mark.parametrize("impl_name", list(IMPLS))
@pytest.mark.parametrize("m, max_fetch, pool, extra, want", CAP_CASES)
def test_fixed_cap_through_ensure(impl_name, m, max_fetch, pool, extra, want):
    cache, out = run_case(impl_name, m, pool, True, dict(max_fetch=max_fetch, **extra))
    check_fetched(cache, out, m, pool, want)
