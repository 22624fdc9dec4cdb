"""Plain reference of the plan copy: for i < num_indices, slots[evict[i]] = host_rows[src[i]]."""
from __future__ import annotations

import torch


def copy_plan_reference(slots_words: torch.Tensor, host_words: torch.Tensor,
                        evict_slots: torch.Tensor, src_indices: torch.Tensor,
                        num_indices: torch.Tensor, col_lo: int = 0, col_hi: int | None = None) -> None:
    """slots_words [S_total, W] and host_words [E, W]: rows as raw 16-bit words; words [col_lo, col_hi)
    of each planned row (default: all of it)."""
    n = int(num_indices.reshape(-1)[0])
    hi = slots_words.shape[1] if col_hi is None else col_hi
    for dst, src in zip(evict_slots[:n].tolist(), src_indices[:n].tolist()):
        slots_words[dst, col_lo:hi].copy_(host_words[src, col_lo:hi].to(slots_words.device))
