"""The fetch-count rule, in plain integer Python: the Triton kernel computes the same, bit for bit.

The fraction f travels as Q16 fixed point (f_q16 = round(f * 65536)), so every product below is
an exact integer and no float rounding can make the kernel and the reference disagree. The encoding is off
by at most 1/2 unit, so f_q16 * M is off from f * M by at most M/2 units: a product within M units of a
whole count of experts is taken as that count (`snapped_product`), and 0.1 of 10 misses is 1 expert in every
mode, not a hair above it. Likewise `min-wait` treats costs within M units of each other as a tie.
"""
from __future__ import annotations

from ftexpert.kernels.slot_cache.state import Q16_ONE, ROUND_MODES

MASK32 = 0xFFFFFFFF
HASH_C1 = 0x7FEB352D
HASH_C2 = 0x846CA68B
HASH_SALT = 0x9E3779B9


def fraction_to_q16(fraction: float) -> int:
    """f in [0, 1] -> Q16 integer in [0, 65536]."""
    if not (0.0 <= fraction <= 1.0):
        raise ValueError(f"fetch_fraction must be within [0, 1], got {fraction!r}")
    return int(round(fraction * Q16_ONE))


def mix32(x: int) -> int:
    """A 32-bit integer finaliser (xor-shift-multiply); the kernel uses the same constants."""
    x &= MASK32
    x ^= x >> 16
    x = (x * HASH_C1) & MASK32
    x ^= x >> 15
    x = (x * HASH_C2) & MASK32
    x ^= x >> 16
    return x


def draw16(seed: int, step: int, layer: int) -> int:
    """Uniform 16-bit draw from (seed, step, layer): reproducible across replays and impls."""
    h = mix32((seed & MASK32) ^ HASH_SALT)
    h = mix32(h ^ (step & MASK32))
    h = mix32(h ^ ((step >> 32) & MASK32))
    h = mix32(h ^ (layer & MASK32))
    return h >> 16


def snapped_product(num_misses: int, frac_q16: int) -> int:
    """f * M in Q16, moved to the whole count of experts it lies within M units of (the encoding's error)."""
    prod = frac_q16 * num_misses
    rest = prod & 0xFFFF
    if rest <= num_misses:
        return prod - rest
    if rest >= Q16_ONE - num_misses:
        return prod - rest + Q16_ONE
    return prod


def fetch_count(num_misses: int, frac_q16: int, round_mode: int, *, seed: int, step: int,
                layer: int) -> int:
    """How many of `num_misses` misses to fetch under fraction f (before promotion and caps)."""
    m = num_misses
    prod = snapped_product(m, frac_q16)      # f*M in Q16
    lo = prod >> 16                          # floor(f*M)
    if round_mode == ROUND_MODES["min-wait"]:
        # of floor and floor+1, the count minimising max(k*(1-f), (M-k)*f); ties (within M units) to the smaller
        hi = lo + 1
        cost_lo = max(lo * (Q16_ONE - frac_q16), (m - lo) * frac_q16)
        cost_hi = max(hi * (Q16_ONE - frac_q16), (m - hi) * frac_q16)
        k = hi if cost_hi < cost_lo - m else lo
    elif round_mode == ROUND_MODES["stochastic"]:
        k = lo + (1 if draw16(seed, step, layer) < (prod & 0xFFFF) else 0)
    elif round_mode == ROUND_MODES["prefer-fetch"]:
        k = (prod + Q16_ONE - 1) >> 16       # ceil(f*M)
    elif round_mode == ROUND_MODES["split"]:
        k = lo                               # floor(f*M): the hybrid backend splits the rest of one expert
    else:
        raise ValueError(f"unknown round mode code {round_mode}")
    return min(k, m)
