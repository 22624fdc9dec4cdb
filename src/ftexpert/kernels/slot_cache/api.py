"""Public entry points of the slot cache: `ensure`, `prefetch_ensure`, `prefetch_score`, `set_policy`, `reset`.

`impl="auto"` runs the Triton kernel on CUDA tensors and the reference elsewhere; `"triton"` on CPU
tensors needs TRITON_INTERPRET=1 set before this package is imported (the Triton interpreter).
"""
from __future__ import annotations

import torch

from ftexpert.kernels.impl import IMPLS, resolve_impl as _resolve_impl  # noqa: F401 (IMPLS: this package's choices)

from ftexpert.kernels.slot_cache import reference
from ftexpert.kernels.slot_cache.fetch_rule import fraction_to_q16
from ftexpert.kernels.slot_cache.state import (ERR_EXPERT_ID, MIN_PART, SMALL_ROUTES_MAX, POLICY_FRAC_Q16, POLICY_LEN, POLICY_MAX_FETCH,
                    POLICY_PROMOTE, POLICY_ROUND, POLICY_SEED, ROUND_MODES, SlotCache)

DEFAULT_SLOT_TILE = 2048      # general kernel: slots per tile of its pool scan
# Decode kernel: one program for pools up to SINGLE_PROGRAM_SLOTS, else DEFAULT_PART slots per
# program (the fastest settings measured on the H200, docs/slot_cache.md).
SINGLE_PROGRAM_SLOTS = 2048
DEFAULT_PART = 1024
SMALL_WARPS = 4
GENERAL_WARPS = 4
MAX_ROUTE_TILE = 1024
MAX_PREFETCH_CANDIDATES = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def small_part(num_slots: int) -> int:
    """Slots per program of the decode kernel for a pool of `num_slots`."""
    if num_slots <= SINGLE_PROGRAM_SLOTS:
        return max(MIN_PART, _next_pow2(num_slots))
    return DEFAULT_PART


def small_launch(num_routes: int, num_slots: int, victim_list: int, slot_tile: int | None = None) -> dict:
    """Grid size and block constexprs of the decode kernel (ensure_small_kernel) for one call."""
    part = max(MIN_PART, _next_pow2(slot_tile or small_part(num_slots)))
    programs = -(-num_slots // part)
    route_block = max(16, _next_pow2(num_routes))
    cand = _next_pow2(route_block + victim_list)
    return dict(programs=programs, PART=part, ROUTE_BLOCK=route_block, V=victim_list, CAND=cand,
                MERGE_BLOCK=_next_pow2(programs * cand), MULTI=programs > 1)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_ids(cache: SlotCache, name: str, ids: torch.Tensor, check_values: bool | None) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {ids.dtype}")
    if ids.device != cache.device:
        raise ValueError(f"{name} is on {ids.device} but the slot cache is on {cache.device}; "
                         f"move them to the same device")
    if not ids.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is rewritten in place); "
                         f"pass tensor.contiguous() and read the result from that tensor")
    if check_values is None:
        check_values = not _capturing(ids.device)
    if check_values and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= cache.num_experts:
            raise ValueError(f"{name} holds expert ids in [{lo}, {hi}] but the model has "
                             f"{cache.num_experts} experts: valid ids are 0..{cache.num_experts - 1}"
                             f" (-1 marks padding)")


def _check_layer(cache: SlotCache, layer: int) -> None:
    if not isinstance(layer, int) or not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer must be an int in [0, {cache.num_layers}), got {layer!r}")


def _policy_codes(max_fetch, fetch_fraction, round_mode, promote, seed):
    if round_mode not in ROUND_MODES:
        raise ValueError(f"round_mode must be one of {', '.join(ROUND_MODES)}, got {round_mode!r}")
    if max_fetch is not None and (not isinstance(max_fetch, int) or max_fetch < 0):
        raise ValueError(f"max_fetch must be None or an int >= 0, got {max_fetch!r}")
    return (-1 if max_fetch is None else max_fetch, fraction_to_q16(float(fetch_fraction)),
            ROUND_MODES[round_mode], int(bool(promote)), int(seed))


def set_policy(cache: SlotCache, *, max_fetch: int | None = None, fetch_fraction: float = 0.0,
               round_mode: str = "min-wait", promote: bool = True, seed: int = 0) -> None:
    """Write the fetch policy into the cache's device tensor, read by `ensure(use_device_policy=True)`.

    Captured CUDA graphs pick the new values up on their next replay without re-capture.
    """
    codes = _policy_codes(max_fetch, fetch_fraction, round_mode, promote, seed)
    values = [0] * POLICY_LEN
    for index, value in zip((POLICY_MAX_FETCH, POLICY_FRAC_Q16, POLICY_ROUND, POLICY_PROMOTE, POLICY_SEED), codes):
        values[index] = value
    cache.policy.copy_(torch.tensor(values, dtype=torch.int64))


def ensure(cache: SlotCache, layer: int, expert_ids: torch.Tensor, *,
           max_fetch: int | None = None, fetch_fraction: float = 0.0, round_mode: str = "min-wait",
           promote: bool = True, seed: int = 0, impl: str = "auto",
           use_device_policy: bool = False, check_ids: bool | None = None,
           slot_tile: int | None = None, path: str = "auto") -> None:
    """Make the routed experts of `layer` resident where the policy says so; rewrite routes in place.

    expert_ids: [...] int32|int64 (-1 = padding). Afterwards each entry is the slot holding that
    expert, or -1 when the miss is left to the CPU. The copy plan (cache.evict_slots,
    cache.src_indices, cache.num_indices) lists the host -> slot copies to make.
    `max_fetch` given: fetch min(M, max_fetch) misses; else the fraction rule with `round_mode`.
    The misses fetched are the most recently routed ones (ties: the lowest id).
    `use_device_policy`: take every policy value from `cache.policy` (see `set_policy`).
    `check_ids`: verify id ranges on the host (a device sync); default: unless capturing a graph.
    Out-of-range ids that reach the kernel unchecked are ignored and flag `cache.error`.
    `path` (Triton only): "small" (decode-sized calls, <= SMALL_ROUTES_MAX routes, pool scan
    spread over several programs), "general" (any size, one program), "auto" picks by size.
    `slot_tile` is the small path's slots per program, or the general path's scan tile; it does
    not change the result (the tests use small tiles to reach several programs / tiles on small
    pools); None takes the defaults measured fastest (docs/slot_cache.md).
    """
    _check_layer(cache, layer)
    _check_ids(cache, "expert_ids", expert_ids, check_ids)
    codes = _policy_codes(max_fetch, fetch_fraction, round_mode, promote, seed)
    if not use_device_policy and codes[0] < 0 and codes[1] >= 1 << 16:
        need = min(cache.num_experts, expert_ids.numel())
        if cache.num_slots < need:
            raise ValueError(
                f"fetching every miss (offload) needs a pool that holds all distinct experts of one "
                f"call: up to {need} here, but the pool has {cache.num_slots} slots; raise "
                f"--moe-cache-size to at least {need}, or use the hybrid or cpu strategy")
    impl = _resolve_impl(impl, cache.device)
    if impl == "reference":
        if use_device_policy:
            codes = tuple(int(v) for v in cache.policy.tolist())
        max_fetch_c, frac_q16, round_c, promote_c, seed_c = codes
        reference.ensure_reference(cache, layer, expert_ids, max_fetch=max_fetch_c, frac_q16=frac_q16,
                                   round_mode=round_c, promote=bool(promote_c), seed=seed_c)
        return
    num_routes = expert_ids.numel()
    if path not in ("auto", "small", "general"):
        raise ValueError(f"path must be 'auto', 'small' or 'general', got {path!r}")
    if path == "small" and num_routes > SMALL_ROUTES_MAX:
        raise ValueError(f"path='small' takes at most {SMALL_ROUTES_MAX} routes, got {num_routes}")
    if path != "general" and num_routes <= SMALL_ROUTES_MAX:
        # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
        from ftexpert.kernels.slot_cache.triton_decode import ensure_small_kernel
        # The victim list relies on keys that only grow between its builds. With the frequency-weighted key a
        # slot's new key after a hit or an install (step + 1 + W * its expert's routes) can fall below older slots'
        # keys (W * more routes), so the decode kernel runs without the list then: every fetch scans.
        shape = small_launch(num_routes, cache.num_slots, 0 if cache.freq_weight else cache.victim_list, slot_tile)
        programs = shape.pop("programs")
        pool = cache.pool_base(layer) // cache.num_slots
        ensure_small_kernel[(programs,)](
            expert_ids, num_routes, cache.slot_for_id, cache.id_of_slot, cache.usage, cache.step,
            cache.expert_recency, cache.mark, cache.evict_slots, cache.src_indices,
            cache.num_indices, cache.num_missing_full, cache.error, cache.policy,
            cache.part_keys, cache.arrive, cache.victim_keys[pool], cache.victim_owner[pool],
            cache.expert_count, cache.freq_weight, cache.freq_half_life, cache.expert_count.numel(),
            layer, cache.pool_base(layer), cache.num_slots, *codes,
            NUM_EXPERTS=cache.num_experts, E_BLOCK=max(16, _next_pow2(cache.num_experts)),
            USE_POLICY=use_device_policy, USE_FREQ=cache.freq_weight > 0,
            num_warps=SMALL_WARPS, **shape)
        return
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.slot_cache.triton_kernels import ensure_kernel
    tile = slot_tile or min(_next_pow2(cache.num_slots), DEFAULT_SLOT_TILE)
    ensure_kernel[(1,)](
        expert_ids, num_routes, cache.slot_for_id, cache.id_of_slot, cache.usage, cache.step,
        cache.expert_recency, cache.mark, cache.evict_slots, cache.src_indices, cache.num_indices,
        cache.num_missing_full, cache.error, cache.policy, cache.expert_count, cache.freq_weight,
        cache.freq_half_life, cache.expert_count.numel(), layer, cache.pool_base(layer), cache.num_slots, *codes,
        NUM_EXPERTS=cache.num_experts, E_BLOCK=max(16, _next_pow2(cache.num_experts)),
        ROUTE_TILE=min(max(16, _next_pow2(num_routes)), MAX_ROUTE_TILE),
        SLOT_TILE=max(16, _next_pow2(tile)), USE_POLICY=use_device_policy, USE_FREQ=cache.freq_weight > 0,
        num_warps=GENERAL_WARPS)



def prefetch_ensure(cache: SlotCache, layer: int, candidates: torch.Tensor, budget: int, *,
                    impl: str = "auto", check_ids: bool | None = None,
                    slot_tile: int | None = None, device_budget: torch.Tensor | None = None,
                    ranks_out: torch.Tensor | None = None) -> None:
    """Install the first `budget` non-resident `candidates` of `layer` as low-priority slots.

    candidates: [C] int32|int64 expert ids in priority order (-1 = none; duplicates count once).
    Victims follow the eviction key and never include a slot used at the current step. The copy
    plan goes to cache.prefetch_evict_slots / prefetch_src_indices / prefetch_num_indices.
    device_budget: [1] int32|int64 on the cache's device: installs at most min(budget, its value), read by the
    kernel (no host sync; a captured graph follows later writes of it). ranks_out: [>= C] int32|int64 on the
    device: each candidate's rank among the distinct valid non-resident ones (0, 1, ...; -1 for the others),
    written whether or not it is installed.
    """
    _check_layer(cache, layer)
    _check_ids(cache, "candidates", candidates, check_ids)
    if candidates.numel() > MAX_PREFETCH_CANDIDATES:
        raise ValueError(f"prefetch_ensure takes at most {MAX_PREFETCH_CANDIDATES} candidates, "
                         f"got {candidates.numel()}; pass the top of the prediction only")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    for name, t, size in (("device_budget", device_budget, 1), ("ranks_out", ranks_out, candidates.numel())):
        if t is not None and (t.device != cache.device or t.dtype not in (torch.int32, torch.int64)
                              or t.numel() < size or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int32/int64 tensor of at least {size} elements on "
                             f"{cache.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    impl = _resolve_impl(impl, cache.device)
    if impl == "reference":
        reference.prefetch_ensure_reference(cache, layer, candidates, budget, device_budget=device_budget,
                                            ranks_out=ranks_out)
        return
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.slot_cache.triton_kernels import prefetch_kernel
    tile = slot_tile or min(_next_pow2(cache.num_slots), DEFAULT_SLOT_TILE)
    pool = cache.pool_base(layer) // cache.num_slots
    prefetch_kernel[(1,)](
        candidates, candidates.numel(), budget, cache.slot_for_id, cache.id_of_slot, cache.usage,
        cache.step, cache.prefetch_evict_slots, cache.prefetch_src_indices,
        cache.prefetch_num_indices, cache.victim_keys[pool], cache.expert_count, cache.freq_weight, layer,
        cache.pool_base(layer), cache.num_slots,
        device_budget if device_budget is not None else candidates,
        ranks_out if ranks_out is not None else candidates, NUM_EXPERTS=cache.num_experts,
        C_BLOCK=max(16, _next_pow2(candidates.numel())), SLOT_TILE=max(16, _next_pow2(tile)),
        V_BLOCK=cache.victim_keys.shape[1], USE_FREQ=cache.freq_weight > 0,
        HAS_DEVICE_BUDGET=device_budget is not None, HAS_RANKS_OUT=ranks_out is not None, num_warps=GENERAL_WARPS)


PREFETCH_SCORE_COUNTERS = 6


def prefetch_score(routed: torch.Tensor, chosen: torch.Tensor, chosen_len: int, num_chosen: torch.Tensor | None,
                   counts: torch.Tensor, *, cand: torch.Tensor | None = None, ranks: torch.Tensor | None = None,
                   k: int = 0, allow: torch.Tensor | None = None, seen: torch.Tensor | None = None,
                   hit: torch.Tensor | None = None, count_installed: bool = False, impl: str = "auto") -> None:
    """Score one layer call's lookahead prefetch against the experts the layer routed, in one launch (no host sync).

    routed [R]: the routed expert ids. chosen [>= chosen_len]: the prefetch's choice for the layer (-1 = none); only
    the first min(chosen_len, num_chosen[0]) count (num_chosen None: chosen_len). counts [6] int64 (the lookahead's
    COUNTERS) gains: the valid chosen, those routed, the valid chosen again when `count_installed` (they were
    installed), and 1 (a layer call scored). With `cand` ([C] the predictor's candidates) also per lane i < k: the
    candidate (none past C) and its rank ranks[i] among the non-resident ones (-1: resident, a duplicate or none):
    seen[rank, else k] += 1 and hit[...] += routed; and of those with 0 <= rank < allow[0] (auto's choice) the
    count to counts[4] and the routed ones to counts[5]. seen, hit: [k + 1] int64."""
    if counts.numel() != PREFETCH_SCORE_COUNTERS or counts.dtype != torch.int64:
        raise ValueError(f"counts must be [{PREFETCH_SCORE_COUNTERS}] int64, got {counts.dtype} {tuple(counts.shape)}")
    if not 0 <= chosen_len <= chosen.numel():
        raise ValueError(f"chosen_len {chosen_len} outside [0, {chosen.numel()}]")
    if cand is not None:
        if any(t is None for t in (ranks, allow, seen, hit)):
            raise ValueError("scoring candidates needs ranks, allow, seen and hit")
        if not cand.numel() <= k <= MAX_PREFETCH_CANDIDATES or ranks.numel() < cand.numel():
            raise ValueError(f"k must lie in [candidates ({cand.numel()}), {MAX_PREFETCH_CANDIDATES}] and ranks "
                             f"hold every candidate; got k {k}, ranks {ranks.numel()}")
        for name, t in (("seen", seen), ("hit", hit)):
            if t.numel() != k + 1 or t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [{k + 1}] int64 tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
    if chosen_len > MAX_PREFETCH_CANDIDATES:
        raise ValueError(f"chosen_len at most {MAX_PREFETCH_CANDIDATES}, got {chosen_len}")
    impl = _resolve_impl(impl, counts.device)
    if impl == "reference":
        reference.prefetch_score_reference(routed, chosen, chosen_len, num_chosen, counts, cand=cand, ranks=ranks,
                                           k=k, allow=allow, seen=seen, hit=hit, count_installed=count_installed)
        return
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.slot_cache.triton_kernels import prefetch_score_kernel
    track = cand is not None
    num_routed = routed.numel()
    prefetch_score_kernel[(1,)](
        routed, num_routed, chosen, chosen_len, num_chosen if num_chosen is not None else chosen,
        cand if track else chosen, cand.numel() if track else 0, ranks if track else chosen, k,
        allow if track else chosen, counts, seen if track else counts, hit if track else counts,
        R_BLOCK=min(64, max(16, _next_pow2(num_routed))), C_BLOCK=max(16, _next_pow2(chosen_len)),
        K_BLOCK=max(16, _next_pow2(k)), HAS_NUM=num_chosen is not None, TRACK=track,
        COUNT_INSTALLED=count_installed, num_warps=SMALL_WARPS)


def raise_on_error(cache: SlotCache) -> None:
    """Host check of the kernels' error flag (a device sync: call it off the hot path)."""
    bits = int(cache.error.item())
    if bits & ERR_EXPERT_ID:
        cache.error.zero_()
        raise ValueError(f"a slot-cache call received expert ids outside [0, {cache.num_experts}); "
                         f"those routes were ignored (check the router output)")
