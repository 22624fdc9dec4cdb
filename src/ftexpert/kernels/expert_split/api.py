"""`split_pick` and `split_copy`: validation and dispatch (Triton on CUDA, the reference elsewhere; `impl=
"triton"` on CPU tensors needs the Triton interpreter, TRITON_INTERPRET=1, as kernels/expert_copy).

The rule (one expert a layer at most). After `ensure` under the `split` rounding mode (which fetches
F = floor(f * M) of the M misses), phi = f * M - F of an expert is still to be fetched for both sides
to finish together. The first route left to the CPU names the split expert e; the GPU takes
g = round(phi * I / SPLIT_UNIT) units of SPLIT_UNIT channels (at most all but one), the CPU keeps
channels [0, c), c = I - g * SPLIT_UNIT (the request line's split limit, proto/shm_layout.py). Every
route of e left to the CPU is rewritten to the split slot (the CPU computes it too, over [0, c));
g = 0 (phi too small), another rounding mode, a fixed fetch cap, or I not a multiple of the unit: no
split. The split slot is a pool row outside the slot cache: its gate and up rows [0, c) are zeroed and
rows [c, I) of gate / up and columns [c, I) of down are fetched, so a whole-expert GEMV over it computes
exactly channels [c, I) (silu(0) * 0 = 0 adds exactly 0 through the finite down columns below c).
Legend: R routes, M misses, F fetched, I intermediate, H hidden, W words of a pool row.
"""
from __future__ import annotations

import torch

from ftexpert.kernels.impl import resolve_impl as _resolve_impl
from ftexpert.kernels.slot_cache.state import POLICY_FRAC_Q16, POLICY_MAX_FETCH, POLICY_ROUND, ROUND_MODES
from ftexpert.proto.shm_layout import SPLIT_CHANNEL_UNIT

from ftexpert.kernels.expert_split.reference import split_copy_reference, split_pick_reference

SPLIT_UNIT = SPLIT_CHANNEL_UNIT      # channels: the CPU kernel's AMX tiles take K in 32s
DESC_EXPERT, DESC_LIMIT, DESC_LEN = 0, 1, 2            # desc: the split expert (-1: none), limit c
COUNT_SPLITS, COUNT_GPU_CHANNELS, COUNTS_LEN = 0, 1, 2   # counts: splits made, channels the GPU took
MAX_ROUTES = 1024
W13_ROWS = 16                         # w13 rows a copy program moves (divides SPLIT_UNIT)
W13_BLOCK = 2048                      # words per load
W2_ROWS = 32                          # w2 rows a copy program moves


def splittable(intermediate: int) -> bool:
    """Whether an expert of `intermediate` channels can be split (at least two whole units)."""
    return intermediate % SPLIT_UNIT == 0 and intermediate >= 2 * SPLIT_UNIT


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, numel: int | None = None) -> None:
    if t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor on {device}, got {t.dtype} on {t.device}")
    if numel is not None and t.numel() < numel:
        raise ValueError(f"{name} needs at least {numel} elements, got {t.numel()}")


def split_pick(routes: torch.Tensor, ids: torch.Tensor, num_missing: torch.Tensor, num_fetched: torch.Tensor,
               policy: torch.Tensor, desc: torch.Tensor, counts: torch.Tensor, *, intermediate: int,
               split_slot: int, impl: str = "auto") -> None:
    """Decide this layer's split (the module docstring) without a host sync.

    routes [T, K] int32 (ensure's output: slot ids, -1 for the CPU; the split expert's -1 routes become
    `split_slot` in place), ids [T, K] int32 (the router's expert ids), num_missing / num_fetched [1] int32
    (the cache's num_missing_full / num_indices after the ensure call), policy: the cache's device policy,
    desc [DESC_LEN] int32 (written), counts [COUNTS_LEN] int64 (added to)."""
    dev = routes.device
    _check("routes", routes, torch.int32, dev)
    _check("ids", ids, torch.int32, dev)
    if ids.numel() != routes.numel():
        raise ValueError(f"ids ({ids.numel()}) and routes ({routes.numel()}) must have as many entries")
    if routes.numel() > MAX_ROUTES:
        raise ValueError(f"split_pick takes at most {MAX_ROUTES} routes (decode batches), got {routes.numel()}")
    for name, t in (("num_missing", num_missing), ("num_fetched", num_fetched)):
        _check(name, t, torch.int32, dev, 1)
    _check("policy", policy, torch.int64, dev, POLICY_ROUND + 1)
    _check("desc", desc, torch.int32, dev, DESC_LEN)
    _check("counts", counts, torch.int64, dev, COUNTS_LEN)
    units = intermediate // SPLIT_UNIT if intermediate % SPLIT_UNIT == 0 else 0
    if _resolve_impl(impl, dev) == "reference":
        split_pick_reference(routes, ids, num_missing, num_fetched, policy, desc, counts, intermediate, SPLIT_UNIT,
                             split_slot)
        return
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.expert_split.triton_kernels import split_pick_kernel
    R = routes.numel()
    split_pick_kernel[(1,)](routes, ids, R, num_missing, num_fetched, policy, desc, counts, split_slot, SPLIT_UNIT,
                            units, POL_MAX_FETCH=POLICY_MAX_FETCH, POL_FRAC=POLICY_FRAC_Q16, POL_ROUND=POLICY_ROUND,
                            ROUND_SPLIT=ROUND_MODES["split"], BLOCK_R=max(16, 1 << max(0, (R - 1).bit_length())),
                            num_warps=1)


def split_copy(slots: torch.Tensor, host_rows: torch.Tensor, desc: torch.Tensor, *, split_slot: int, hidden: int,
               intermediate: int, part: int, impl: str = "auto") -> None:
    """Fetch the GPU's part of the split expert desc names into pool row `split_slot` (nothing when desc says
    no split). part 0: w13 (gate and up rows [0, c) zeroed, rows [c, I) fetched); part 1: w2 columns
    [c, I). slots [S, N] device pool (packed rows, kernels/expert_copy's layout), host_rows [E, N] the
    layer's host rows (pinned / registered on CUDA), desc [DESC_LEN] int32 from split_pick."""
    if part not in (0, 1):
        raise ValueError(f"part must be 0 (w13) or 1 (w2), got {part!r}")
    if slots.dtype != host_rows.dtype or slots.shape[1] != host_rows.shape[1]:
        raise ValueError(f"slots {tuple(slots.shape)} {slots.dtype} and host rows {tuple(host_rows.shape)} "
                         f"{host_rows.dtype} must share dtype and row size")
    if slots.shape[1] != 3 * hidden * intermediate or slots.element_size() not in (2, 4):
        raise ValueError(f"pool rows of {slots.shape[1]} {slots.dtype} elements are not packed experts of "
                         f"H={hidden}, I={intermediate} (3*H*I elements of 2 or 4 bytes)")
    if not 0 <= split_slot < slots.shape[0]:
        raise ValueError(f"split_slot {split_slot} is outside the pool's {slots.shape[0]} rows")
    if not splittable(intermediate):
        raise ValueError(f"an expert of {intermediate} channels is not split (needs a multiple of {SPLIT_UNIT}, "
                         f">= {2 * SPLIT_UNIT})")
    _check("desc", desc, torch.int32, slots.device, DESC_LEN)
    if slots.stride(1) != 1 or host_rows.stride(1) != 1:
        raise ValueError("slots and host_rows need contiguous rows")
    slot_words, host_words = slots.view(torch.int16), host_rows.view(torch.int16)
    per = slots.element_size() // 2
    if _resolve_impl(impl, slots.device) == "reference":
        split_copy_reference(slot_words, host_words, desc, split_slot, hidden, intermediate, part)
        return
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.expert_split.triton_kernels import split_copy_w2_kernel, split_copy_w13_kernel
    aligned = host_words.data_ptr() % 16 == 0 and host_words.stride(0) % 8 == 0
    hw = hidden * per
    if part == 0:
        split_copy_w13_kernel[(2 * intermediate // W13_ROWS,)](
            slot_words, host_words.data_ptr(), host_words.stride(0), desc, split_slot, slot_words.shape[1], hw,
            intermediate, ROWS=W13_ROWS, BLOCK=W13_BLOCK, ALIGNED=aligned, num_warps=4)
    else:
        split_copy_w2_kernel[(-(-hidden // W2_ROWS),)](
            slot_words, host_words.data_ptr(), host_words.stride(0), desc, split_slot, slot_words.shape[1],
            2 * intermediate * hw, hidden, intermediate * per, PER=per, UNIT=SPLIT_UNIT, ROWS=W2_ROWS,
            ALIGNED=aligned, EVEN_ROWS=hidden % W2_ROWS == 0, num_warps=4)
