"""kernels/expert_split: the per-layer split decision and the split slot's copy against their references, the
rule worked by hand, and moe_gemv waiting for the split slot as for the copy plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftexpert.kernels.expert_split import (COUNTS_LEN, DESC_LEN, SPLIT_UNIT, split_copy, split_pick, splittable)
from ftexpert.kernels.expert_split.reference import gpu_units
from ftexpert.kernels.moe_decode import CopyPlan, moe_gemv
from ftexpert.kernels.slot_cache import SlotCache, set_policy
from tests.conftest import KERNEL_DEVICE

Q16 = 1 << 16


@pytest.mark.parametrize("frac, misses, fetched, units, want", [
    (0.5, 5, 2, 24, 12),         # phi = 0.5 expert: half of the channels
    (0.4, 5, 2, 24, 0),          # f*M = 2 (in Q16 just below): nothing left to fetch
    (0.45, 3, 1, 24, 8),         # phi = 0.35 -> 8.4 units -> 8
    (0.99, 4, 0, 24, 23),        # phi > 1 (a cap kept F low): all but one unit
    (0.01, 1, 0, 24, 0),         # phi * 24 < 0.5 unit: no split
    (0.5, 3, 2, 24, 0),          # promotion fetched past f*M
])
def test_the_rule_by_hand(frac, misses, fetched, units, want):
    assert gpu_units(round(frac * Q16), misses, fetched, units) == want


def _case(seed: int, T: int, K: int, E: int, slots: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    routes = ids.clone()
    cpu = torch.rand(T, K, generator=gen) < 0.5
    same = ids == ids[0, 0]                          # an expert of several tokens: all its routes go alike
    cpu = torch.where(same, cpu[0, 0], cpu)
    routes = torch.where(cpu, torch.full_like(routes, -1), torch.randint(0, slots, (T, K), generator=gen,
                                                                         dtype=torch.int32))
    return ids, routes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("round_mode", ["split", "min-wait"])
def test_split_pick_matches_the_reference(seed, round_mode):
    E, slots, inter = 16, 10, 4 * SPLIT_UNIT
    T, K = (1, 4) if seed % 2 else (3, 4)
    ids, routes = _case(seed, T, K, E, slots)
    ids[0, 0] = ids[-1, -1] if T > 1 else ids[0, 0]          # a repeated expert across tokens
    cache = SlotCache.create(2, E, slots, device="cpu")
    set_policy(cache, fetch_fraction=[0.3, 0.5, 0.7, 0.45, 0.9, 0.6][seed], round_mode=round_mode)
    missing = torch.tensor([int((routes < 0).sum()) + seed % 3], dtype=torch.int32)
    fetched = torch.tensor([seed % 3], dtype=torch.int32)
    outs = []
    for impl, dev in (("reference", "cpu"), ("triton", KERNEL_DEVICE)):
        r = routes.clone().to(dev)
        desc = torch.full((DESC_LEN,), 7, dtype=torch.int32, device=dev)
        counts = torch.tensor([3, 5], dtype=torch.int64, device=dev)
        split_pick(r, ids.to(dev), missing.to(dev), fetched.to(dev), cache.policy.to(dev), desc, counts,
                   intermediate=inter, split_slot=slots, impl=impl)
        outs.append((r.cpu(), desc.cpu(), counts.cpu()))
    (r0, d0, c0), (r1, d1, c1) = outs
    assert torch.equal(r0, r1) and torch.equal(d0, d1) and torch.equal(c0, c1)
    if round_mode != "split" or d0[0] < 0:
        assert d0.tolist() == [-1, 0] and torch.equal(r0, routes) and c0.tolist() == [3, 5]
        return
    expert, limit = d0.tolist()
    first = int(torch.nonzero(routes.view(-1) < 0)[0])
    assert expert == int(ids.view(-1)[first]) and 0 < limit < inter and limit % SPLIT_UNIT == 0
    moved = (routes < 0) & (ids == expert)
    assert torch.equal(r0, torch.where(moved, torch.full_like(routes, slots), routes))
    assert c0.tolist() == [4, 5 + inter - limit]


def test_nothing_is_split_without_a_cpu_route_or_with_a_fetch_cap():
    dev = KERNEL_DEVICE
    cache = SlotCache.create(1, 8, 4, device=dev)
    ids = torch.tensor([[1, 2]], dtype=torch.int32, device=dev)
    for routes, cap in (([[0, 1]], None), ([[-1, 1]], 1)):
        set_policy(cache, fetch_fraction=0.5, round_mode="split", max_fetch=cap)
        desc = torch.zeros(DESC_LEN, dtype=torch.int32, device=dev)
        counts = torch.zeros(COUNTS_LEN, dtype=torch.int64, device=dev)
        split_pick(torch.tensor(routes, dtype=torch.int32, device=dev), ids,
                   torch.tensor([3], dtype=torch.int32, device=dev), torch.tensor([0], dtype=torch.int32, device=dev),
                   cache.policy, desc, counts, intermediate=64, split_slot=4, impl="triton")
        assert desc.tolist() == [-1, 0] and counts.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [SPLIT_UNIT, 2 * SPLIT_UNIT, 3 * SPLIT_UNIT, None])
@pytest.mark.parametrize("H", [96, 80], ids=["H96", "H80-ragged"])    # 80: not a multiple of the w2 row block
def test_split_copy_matches_the_reference_and_moves_the_gpus_channels_only(dtype, limit, H):
    I, E, S = 4 * SPLIT_UNIT, 5, 3
    N = 3 * H * I
    gen = torch.Generator().manual_seed(limit or 0)
    backing = torch.randn(E, N + 64, generator=gen).to(dtype)
    if KERNEL_DEVICE == "cuda":
        backing = backing.pin_memory()
    host = backing[:, :N]
    before = torch.randn(S + 1, N, generator=gen).to(dtype)          # stale bytes everywhere
    desc = torch.tensor([3, limit] if limit else [-1, 0], dtype=torch.int32)
    ref, ker = before.clone(), before.clone().to(KERNEL_DEVICE)
    for part in (0, 1):
        split_copy(ref, host, desc, split_slot=S, hidden=H, intermediate=I, part=part, impl="reference")
        split_copy(ker, host, desc.to(KERNEL_DEVICE), split_slot=S, hidden=H, intermediate=I, part=part, impl="triton")
    assert torch.equal(ref.view(torch.int16), ker.cpu().view(torch.int16))          # bit for bit
    assert torch.equal(ref[:S], before[:S])                                         # other rows untouched
    if limit is None:
        assert torch.equal(ref, before)
        return
    c = limit
    got, src, old = ref[S], host[3], before[S]
    gate, up = got[:I * H].view(I, H), got[I * H:2 * I * H].view(I, H)
    assert (gate[:c] == 0).all() and torch.equal(gate[c:], src[:I * H].view(I, H)[c:])
    assert (up[:c] == 0).all() and torch.equal(up[c:], src[I * H:2 * I * H].view(I, H)[c:])
    down, sdown = got[2 * I * H:].view(H, I), src[2 * I * H:].view(H, I)
    assert torch.equal(down[:, c:], sdown[:, c:]) and torch.equal(down[:, :c], old[2 * I * H:].view(H, I)[:, :c])
    # a whole-expert FFN over the split slot is exactly the expert's channels [c, I)
    x = torch.randn(2, H, generator=gen, dtype=torch.float64)
    w13, w2 = got[:2 * I * H].view(2 * I, H).double(), down.double()
    whole = F.linear(F.silu(F.linear(x, w13[:I])) * F.linear(x, w13[I:]), w2)
    s13 = src[:2 * I * H].view(2 * I, H).double()
    part_ = F.linear(F.silu(F.linear(x, s13[c:I])) * F.linear(x, s13[I + c:]), sdown.double()[:, c:])
    torch.testing.assert_close(whole, part_, rtol=1e-12, atol=1e-12)


def test_split_copy_refuses_what_it_cannot_split():
    slots = torch.zeros(2, 3 * 8 * 48)
    with pytest.raises(ValueError, match="not split"):
        split_copy(slots, slots.clone(), torch.tensor([0, 32], dtype=torch.int32), split_slot=1, hidden=8,
                   intermediate=48, part=0)
    assert splittable(64) and not splittable(48) and not splittable(32)
    with pytest.raises(ValueError, match="outside the pool"):
        split_copy(torch.zeros(2, 3 * 8 * 64), torch.zeros(2, 3 * 8 * 64), torch.tensor([0, 32], dtype=torch.int32),
                   split_slot=2, hidden=8, intermediate=64, part=1)


def test_moe_gemv_computes_the_split_slot_after_the_copy_lands():
    """The split slot's route belongs to the second launch (after between()), like the plan's slots: computed
    earlier it would read the stale row."""
    H, I, S = 64, 32, 4
    gen = torch.Generator().manual_seed(3)
    slots = (torch.randn(S + 1, 3 * H * I, generator=gen) * 0.1).to(KERNEL_DEVICE)
    landed = (torch.randn(3 * H * I, generator=gen) * 0.1).to(KERNEL_DEVICE)
    w13 = slots[:, :2 * I * H].view(S + 1, 2 * I, H)
    w2 = slots[:, 2 * I * H:].view(S + 1, H, I)
    x = torch.randn(1, H, generator=gen).to(KERNEL_DEVICE)
    ids = torch.tensor([[1, S]], dtype=torch.int32, device=KERNEL_DEVICE)
    w = torch.tensor([[0.6, 0.4]], device=KERNEL_DEVICE)
    plan = CopyPlan(torch.tensor([2], dtype=torch.int32, device=KERNEL_DEVICE),
                    torch.tensor([1], dtype=torch.int32, device=KERNEL_DEVICE), 1, extra_slot=S)

    def land():
        slots[S].copy_(landed)
    got = moe_gemv(x, ids, w, w13, w2, impl="triton", plan=plan, between=land)
    want = moe_gemv(x, ids, w, w13, w2, impl="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
