"""Misuse of the slot-cache API gets a clear error, and nothing in the state changes."""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels.slot_cache import SlotCache, ensure, prefetch_ensure, raise_on_error, reset
from tests.conftest import KERNEL_DEVICE
from tests.kernels.slot_cache_util import assert_same_state


@pytest.fixture
def cache():
    c = SlotCache.create(2, 8, 4)
    ensure(c, 0, torch.tensor([[1, 2]]), fetch_fraction=1.0)
    return c


@pytest.mark.parametrize("bad_ids, match", [
    (torch.tensor([[1, 8]]), r"expert ids in \[1, 8\].*8 experts"),
    (torch.tensor([[-2, 1]]), r"valid ids are 0\.\.7"),
])
def test_expert_id_out_of_range(cache, bad_ids, match):
    before = cache.clone()
    with pytest.raises(ValueError, match=match):
        ensure(cache, 0, bad_ids, fetch_fraction=0.5)
    assert_same_state(before, cache, "after a rejected call")


def test_wrong_dtype_and_layout(cache):
    with pytest.raises(TypeError, match="int32 or int64"):
        ensure(cache, 0, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="contiguous"):
        ensure(cache, 0, torch.arange(8).reshape(2, 4).t())


def test_wrong_device(cache):
    with pytest.raises(ValueError, match="same device"):
        ensure(cache, 0, torch.tensor([[1, 2]], device="meta"))


def test_offload_pool_too_small(cache):
    with pytest.raises(ValueError, match="--moe-cache-size to at least 5"):
        ensure(cache, 0, torch.tensor([[0, 1, 2, 3, 4]]), fetch_fraction=1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(round_mode="nearest"), "round_mode must be one of"),
    (dict(fetch_fraction=1.5), r"within \[0, 1\]"),
    (dict(max_fetch=-1), "max_fetch must be None or an int >= 0"),
    (dict(impl="cuda"), "impl must be"),
])
def test_bad_policy_arguments(cache, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ensure(cache, 0, torch.tensor([[1]]), **kwargs)


def test_bad_layer_and_budget(cache):
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        ensure(cache, 2, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="budget must be"):
        prefetch_ensure(cache, 0, torch.tensor([3]), -1)
    with pytest.raises(ValueError, match="at most 128 candidates"):
        prefetch_ensure(cache, 0, torch.zeros(200, dtype=torch.int64), 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_slots=0), "num_slots must be a positive int"),
    (dict(num_slots=1 << 25), "exceeds the kernel's limit"),
    (dict(num_experts=-3), "num_experts must be a positive int"),
    # the decode kernel packs owner ids (layer * E + expert) into 30 bits and list positions into 7
    (dict(num_layers=1 << 15, num_experts=1 << 15), "experts in all"),
    (dict(victim_list=128), "power of two up to 64"),
    (dict(victim_list=24), "power of two up to 64"),
])
def test_bad_create(kwargs, match):
    args = dict(num_layers=2, num_experts=8, num_slots=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SlotCache.create(**args)


def test_unchecked_bad_ids_reach_the_kernel_flag_and_are_ignored():
    ker = SlotCache.create(2, 8, 4, device=KERNEL_DEVICE)
    ids = torch.tensor([[1, 9, 2]], device=KERNEL_DEVICE)
    ensure(ker, 0, ids, fetch_fraction=1.0, impl="triton", check_ids=False)
    assert ids.tolist()[0][1] == -1, "an out-of-range route must not index the slot maps"
    assert sorted(ker.slot_for_id[0].tolist()).count(-1) == 6, "exactly experts 1 and 2 resident"
    with pytest.raises(ValueError, match="outside"):
        raise_on_error(ker)
    raise_on_error(ker)   # the flag was cleared


def test_reset_empties_the_pool(cache):
    reset(cache)
    assert int((cache.slot_for_id >= 0).sum()) == 0 and int(cache.step) == 0
    assert bool((cache.usage == -1).all()) and bool((cache.expert_recency == -1).all())
