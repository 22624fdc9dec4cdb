"""`audit`: the slot cache's invariants checked on the host (FREETOKEN_MOE_SLOT_AUDIT, the tests).

The maps must stay each other's inverse (no expert in two slots, no slot claimed by two experts), every
occupied slot must lie in the pool that serves its expert's layer, empty slots and usage -1 must agree,
and no usage may run ahead of the step counter. With `slots` and `host_layers` given, up to
`sample_slots` occupied slots (chosen at random) must also hold their expert's bytes, bit for bit: that
catches a copy that never landed or landed in the wrong slot, which the maps alone cannot show.

The checks copy the maps to the host (a device sync); the engine runs them every N decode steps.
"""
from __future__ import annotations

import torch

from .state import SlotCache

MAX_PROBLEMS = 8           # problems listed (each names a few offending slots)


def _few(t: torch.Tensor, n: int = 4) -> list[int]:
    return t.reshape(-1)[:n].tolist()


def audit(cache: SlotCache, *, slots: torch.Tensor | None = None, host_layers=None, sample_slots: int = 0,
          seed: int = 0) -> list[str]:
    """Problems found (empty: the cache is consistent). slots: [S_total, N] the slot pool; host_layers[l]:
    [E, N] layer l's expert rows; sample_slots: how many occupied slots to compare byte for byte."""
    sfi = cache.slot_for_id.detach().to("cpu", torch.int64).reshape(-1)        # [L*E]
    ios = cache.id_of_slot.detach().to("cpu", torch.int64)                      # [S_total]
    usage = cache.usage.detach().cpu()
    step = int(cache.step.detach().cpu()[0])
    total, num_ids = ios.numel(), sfi.numel()
    problems: list[str] = []

    occupied = (ios >= 0).nonzero().reshape(-1)
    owners = ios[occupied]
    if bool((owners >= num_ids).any()):
        problems.append(f"slots {_few(occupied[owners >= num_ids])} hold ids past the last expert ({num_ids - 1})")
        occupied, owners = occupied[owners < num_ids], owners[owners < num_ids]
    if owners.unique().numel() != owners.numel():
        values, counts = owners.unique(return_counts=True)
        problems.append(f"experts {_few(values[counts > 1])} are held by two slots or more")
    disowned = occupied[sfi[owners] != occupied]
    if disowned.numel():
        problems.append(f"slots {_few(disowned)} hold experts {_few(ios[disowned])} whose map names another slot")
    layers = owners // cache.num_experts
    base = layers * cache.num_slots if cache.per_layer else torch.zeros_like(layers)
    outside = occupied[(occupied < base) | (occupied >= base + cache.num_slots)]
    if outside.numel():
        problems.append(f"slots {_few(outside)} serve layers outside their pool")
    mapped = (sfi >= 0).nonzero().reshape(-1)
    targets = sfi[mapped]
    if bool((targets >= total).any()):
        problems.append(f"experts {_few(mapped[targets >= total])} map to slots past the pool's end ({total - 1})")
        mapped, targets = mapped[targets < total], targets[targets < total]
    stray = mapped[ios[targets] != mapped]
    if stray.numel():
        problems.append(f"experts {_few(stray)} map to slots {_few(sfi[stray])} that hold other experts")
    mismatch = ((ios < 0) != (usage < 0)).nonzero().reshape(-1)
    if mismatch.numel():
        problems.append(f"slots {_few(mismatch)}: occupancy and usage disagree (empty slots have usage -1)")
    ahead = (usage > step).nonzero().reshape(-1)
    if ahead.numel():
        problems.append(f"slots {_few(ahead)} were used at steps past the step counter ({step})")

    if sample_slots > 0 and slots is not None and host_layers is not None and occupied.numel():
        gen = torch.Generator().manual_seed(seed)
        pick = occupied[torch.randperm(occupied.numel(), generator=gen)[:sample_slots]]
        wrong = []
        for s in pick.tolist():
            flat = int(ios[s])
            layer, expert = divmod(flat, cache.num_experts)
            got = slots[s].detach().cpu().view(torch.int16)
            want = host_layers[layer][expert].view(torch.int16)
            if not torch.equal(got, want):
                wrong.append((s, layer, expert))
        if wrong:
            problems.append("slots " + ", ".join(f"{s} (layer {l}, expert {e})" for s, l, e in wrong[:4])
                            + " do not hold their expert's bytes")
    return problems[:MAX_PROBLEMS]
