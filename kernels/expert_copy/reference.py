"""Plain reference of the plan copy: for i < num_indices, slots[evict[i]] = host_rows[src[i]]."""
from __future__ import annotations

import torch


def copy_plan_reference(slots_words: torch.Tensor, host_words: torch.Tensor,
                        evict_slots: torch.Tensor, src_indices: torch.Tensor,
                        num_indices: torch.Tensor) -> None:
    """slots_words [S_total, W] and host_words [E, W]: rows as raw 16-bit words."""
    n = int(num_indices.reshape(-1)[0])
    for dst, src in zip(evict_slots[:n].tolist(), src_indices[:n].tolist()):
        slots_words[dst].copy_(host_words[src].to(slots_words.device))
