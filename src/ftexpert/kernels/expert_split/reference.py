"""Plain references of the split kernels (integer Python and torch indexing)."""
from __future__ import annotations

import torch

from ftexpert.kernels.slot_cache.state import POLICY_FRAC_Q16, POLICY_MAX_FETCH, POLICY_ROUND, Q16_ONE, ROUND_MODES


def gpu_units(frac_q16: int, num_misses: int, num_fetched: int, units: int) -> int:
    """Units of SPLIT_UNIT channels of one expert the GPU takes: phi = f*M - F experts (Q16), rounded to the
    nearest unit (halves up), at most units - 1 (the CPU keeps at least one); 0: no split."""
    phi = frac_q16 * num_misses - num_fetched * Q16_ONE
    if phi <= 0:
        return 0
    return min((phi * units + Q16_ONE // 2) >> 16, units - 1)


def split_pick_reference(routes: torch.Tensor, ids: torch.Tensor, num_missing: torch.Tensor,
                         num_fetched: torch.Tensor, policy: torch.Tensor, desc: torch.Tensor, counts: torch.Tensor,
                         intermediate: int, unit: int, split_slot: int) -> None:
    """See api.split_pick."""
    flat_r, flat_e = routes.view(-1), ids.view(-1)
    p = [int(v) for v in policy.tolist()]
    units = intermediate // unit if intermediate % unit == 0 else 0
    cpu = [i for i in range(flat_r.numel()) if int(flat_r[i]) < 0 and int(flat_e[i]) >= 0]
    g = 0
    if p[POLICY_ROUND] == ROUND_MODES["split"] and p[POLICY_MAX_FETCH] < 0 and cpu and units >= 2:
        g = gpu_units(p[POLICY_FRAC_Q16], int(num_missing.view(-1)[0]), int(num_fetched.view(-1)[0]), units)
    if g <= 0:
        desc[0], desc[1] = -1, 0
        return
    expert = int(flat_e[cpu[0]])
    for i in cpu:
        if int(flat_e[i]) == expert:
            flat_r[i] = split_slot
    desc[0], desc[1] = expert, (units - g) * unit
    counts[0] += 1
    counts[1] += g * unit


def split_copy_reference(slot_words: torch.Tensor, host_words: torch.Tensor, desc: torch.Tensor, split_slot: int,
                         hidden: int, intermediate: int, part: int) -> None:
    """See api.split_copy; rows as raw 16-bit words, `per` words an element."""
    expert, limit = int(desc[0]), int(desc[1])
    if expert < 0:
        return
    per = slot_words.shape[1] // (3 * hidden * intermediate)
    H, I, c = hidden * per, intermediate, limit
    dst, src = slot_words[split_slot], host_words[expert].to(slot_words.device)
    if part == 0:                                       # w13: zero gate and up rows [0, c), copy rows [c, I)
        dst[:c * H].zero_()
        dst[I * H:(I + c) * H].zero_()
        dst[c * H:I * H].copy_(src[c * H:I * H])
        dst[(I + c) * H:2 * I * H].copy_(src[(I + c) * H:2 * I * H])
    else:                                               # w2 [H rows, I]: columns [c, I) of every row
        base = 2 * I * H
        d = dst[base:base + hidden * I * per].view(hidden, I * per)
        s = src[base:base + hidden * I * per].view(hidden, I * per)
        d[:, c * per:].copy_(s[:, c * per:])
