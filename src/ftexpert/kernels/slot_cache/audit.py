"""`audit`: the slot cache's invariants checked on the host (FREETOKEN_MOE_SLOT_AUDIT, the tests).

The maps must stay each other's inverse (no expert in two slots, no slot claimed by two experts), every
occupied slot must lie in the pool that serves its expert's layer, empty slots and usage -1 must agree,
no map or key may hold a value below -1, no usage or recency may run ahead of the step counter, and the
kernels' error word must be clear (a kernel that saw bad input, e.g. a router id out of range, sets it).
With `slots` and `host_layers` given, slots must also hold their expert's bytes, bit for bit, which
catches a copy that never landed, landed in part or in the wrong slot (the maps alone cannot show that):
the `sample_slots` most recently used slots whole (where the latest copies landed), and three windows of
PROBE_WORDS elements (the row's start, middle and end) of up to `probe_slots` other occupied slots drawn
at random, gathered on the device in one go.

Cost: the maps to the host (a device sync), plus the compared bytes (two whole 9.44 MB experts and 64 x
3 small windows by default from the engine: ~20 MB); the engine runs it every N decode steps.
"""
from __future__ import annotations

import torch

from ftexpert.kernels.slot_cache.state import SlotCache

MAX_PROBLEMS = 8           # problems listed (each names a few offending slots)
PROBE_WORDS = 256          # elements in each window of a probed slot


def _few(t: torch.Tensor, n: int = 4) -> list[int]:
    return t.reshape(-1)[:n].tolist()


def _below(where: torch.Tensor, values: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(where, values) kept where values < limit, and the `where` entries whose value is past it."""
    past = values >= limit
    return where[~past], values[~past], where[past]


def audit(cache: SlotCache, *, slots: torch.Tensor | None = None, host_layers=None, sample_slots: int = 0,
          probe_slots: int = 0, seed: int = 0) -> list[str]:
    """Problems found (empty: the cache is consistent). slots: [S_total, N] the slot pool; host_layers[l]:
    [E, N] layer l's expert rows; sample_slots: the most recently used slots to compare whole; probe_slots:
    other occupied slots, at random, whose three windows are compared."""
    sfi = cache.slot_for_id.detach().to("cpu", torch.int64).reshape(-1)        # [L*E]
    ios = cache.id_of_slot.detach().to("cpu", torch.int64)                      # [S_total]
    usage = cache.usage.detach().cpu()
    step = int(cache.step.detach().cpu()[0])
    total, num_ids = ios.numel(), sfi.numel()
    problems: list[str] = []
    error = int(cache.error.detach().cpu()[0])
    if error:
        problems.append(f"the kernels' error word is {error:#x} (bad input seen: kernels.slot_cache.raise_on_error "
                        "names it)")
    recency = cache.expert_recency.detach().cpu().reshape(-1)
    for name, values in (("id_of_slot", ios), ("slot_for_id", sfi), ("usage", usage), ("expert_recency", recency)):
        below = (values < -1).nonzero().reshape(-1)
        if below.numel():
            problems.append(f"{name} holds values below -1 at {_few(below)}")
    late = (recency > step).nonzero().reshape(-1)
    if late.numel():
        problems.append(f"experts {_few(late)} were routed at steps past the step counter ({step})")

    occupied = (ios >= 0).nonzero().reshape(-1)
    occupied, owners, past = _below(occupied, ios[occupied], num_ids)
    if past.numel():
        problems.append(f"slots {_few(past)} hold ids past the last expert ({num_ids - 1})")
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
    mapped, targets, past = _below(mapped, sfi[mapped], total)
    if past.numel():
        problems.append(f"experts {_few(past)} map to slots past the pool's end ({total - 1})")
    stray = mapped[ios[targets] != mapped]
    if stray.numel():
        problems.append(f"experts {_few(stray)} map to slots {_few(sfi[stray])} that hold other experts")
    mismatch = ((ios < 0) != (usage < 0)).nonzero().reshape(-1)
    if mismatch.numel():
        problems.append(f"slots {_few(mismatch)}: occupancy and usage disagree (empty slots have usage -1)")
    ahead = (usage > step).nonzero().reshape(-1)
    if ahead.numel():
        problems.append(f"slots {_few(ahead)} were used at steps past the step counter ({step})")

    if slots is not None and host_layers is not None and occupied.numel() and (sample_slots > 0 or probe_slots > 0):
        problems += _byte_checks(cache, ios, occupied, usage, slots, host_layers, sample_slots, probe_slots, seed)
    return problems[:MAX_PROBLEMS]


def _byte_checks(cache: SlotCache, ios: torch.Tensor, occupied: torch.Tensor, usage: torch.Tensor,
                 slots: torch.Tensor, host_layers, sample_slots: int, probe_slots: int, seed: int) -> list[str]:
    def owner(s: int) -> tuple[int, int]:
        return divmod(int(ios[s]), cache.num_experts)

    def host_row(s: int) -> torch.Tensor:
        layer, expert = owner(s)
        return host_layers[layer][expert]

    wrong: list[int] = []
    recent = occupied[torch.argsort(usage[occupied], descending=True, stable=True)[:sample_slots]]   # ties: low slot
    for s in recent.tolist():                       # whole rows, bit for bit
        if not torch.equal(slots[s].detach().cpu().view(torch.uint8), host_row(s).view(torch.uint8)):
            wrong.append(s)
    rest = occupied[~torch.isin(occupied, recent)]
    if probe_slots > 0 and rest.numel():
        gen = torch.Generator().manual_seed(seed)
        probe = rest[torch.randperm(rest.numel(), generator=gen)[:probe_slots]]
        n = slots.shape[1]
        w = min(PROBE_WORDS, n)
        cols = torch.cat([torch.arange(0, w), torch.arange((n - w) // 2, (n - w) // 2 + w), torch.arange(n - w, n)])
        got = slots[probe.to(slots.device)[:, None], cols.to(slots.device)[None, :]].detach().cpu()   # one gather
        for row, s in zip(got, probe.tolist()):
            if not torch.equal(row.view(torch.uint8), host_row(s)[cols].view(torch.uint8)):
                wrong.append(s)
    if not wrong:
        return []
    return ["slots " + ", ".join(f"{s} (layer {owner(s)[0]}, expert {owner(s)[1]})" for s in wrong[:4])
            + f" do not hold their expert's bytes ({len(wrong)} of the slots compared)"]
