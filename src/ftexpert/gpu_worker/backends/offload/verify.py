"""`SlotVerifier`: the prefetch's debug detector, FREETOKEN_MOE_PREFETCH_VERIFY (default off: never built).

`meta` checks, after every decode-sized ensure, each routed slot's maps: the slot holds the routed expert
(`id_of_slot`) and the expert maps to the slot (`slot_for_id`). `1` also compares the slots' bytes with the
expert's host row: the hits' before the layer's GEMMs (a slot a prefetch or an earlier layer filled), every
routed slot's after them (a copy that never landed, landed in part, or a write while the GEMM read). Each check
syncs the device, so a backend with the verifier does not capture decode graphs. A failure raises
`SlotVerifyError` naming the layer, the expert and the slot.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.backends.offload.prefetch import VERIFY_MODES


class SlotVerifyError(RuntimeError):
    """A routed slot whose maps or bytes are not its expert's (FREETOKEN_MOE_PREFETCH_VERIFY)."""


class SlotVerifier:
    def __init__(self, mode: str, cache, slots: torch.Tensor, host_layers):
        if mode not in VERIFY_MODES or mode == "off":
            raise ValueError(f"SlotVerifier mode {mode!r}: use meta or 1")
        self.mode, self.cache, self.slots, self.host_layers = mode, cache, slots, host_layers
        self.checks = 0

    def check(self, layer: int, ids: torch.Tensor, slot_ids: torch.Tensor, *, after: bool) -> None:
        """ids [T, K] the router's experts, slot_ids [T, K] their slots (-1: not on the GPU)."""
        c = self.cache
        e = ids.reshape(-1).cpu().tolist()
        s = slot_ids.reshape(-1).cpu().tolist()
        id_of_slot = c.id_of_slot.cpu()
        slot_for_id = c.slot_for_id.reshape(-1).cpu()
        row = layer * c.num_experts
        planned = set(c.evict_slots[:int(c.num_indices)].cpu().tolist())
        self.checks += 1
        for expert, slot in sorted(set(zip(e, s))):
            if expert < 0 or slot < 0:
                continue
            if int(id_of_slot[slot]) != row + expert or int(slot_for_id[row + expert]) != slot:
                raise SlotVerifyError(
                    f"layer {layer} expert {expert} routed to slot {slot}, but id_of_slot[{slot}] = "
                    f"{int(id_of_slot[slot])} and slot_for_id[{row + expert}] = {int(slot_for_id[row + expert])} "
                    f"(want {row + expert} and {slot}): a stale slot map")
            if self.mode != "1" or (not after and slot in planned):
                continue
            have = self.slots[slot].cpu()
            want = self.host_layers[layer][expert].cpu()
            if not torch.equal(have.view(torch.uint8), want.view(torch.uint8)):
                bad = int((have.view(torch.uint8) != want.view(torch.uint8)).sum())
                raise SlotVerifyError(
                    f"layer {layer} expert {expert} in slot {slot}: {bad} bytes differ from the host row "
                    f"{'after' if after else 'before'} the expert GEMM (a copy that did not land, or a write "
                    f"while the GEMM read)")
