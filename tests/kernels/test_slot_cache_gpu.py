"""The slot-cache lockstep on a real GPU, at pool sizes of real deployments.

Per pool: calls compared one by one against the reference, then a long run of calls queued back to
back with no host copy in between, compared afterwards route by route and by final state.
72,000 back-to-back calls in all (18,000 per pool).
"""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels.slot_cache import SlotCache, ensure, prefetch_ensure, raise_on_error
from tests.kernels.slot_cache_util import RouteGen, assert_same_state, check_invariants, check_victim_list

NUM_LAYERS, NUM_EXPERTS = 61, 512         # 31,232 experts: more than the largest pool
TOKENS, TOP_K = 4, 8
STEP_CALLS, BACK_TO_BACK_CALLS = 600, 18_000
POLICIES = [dict(fetch_fraction=1.0), dict(fetch_fraction=0.4, round_mode="min-wait"),
            dict(fetch_fraction=0.3, round_mode="stochastic", seed=5),
            dict(fetch_fraction=0.25, round_mode="prefer-fetch"),
            dict(fetch_fraction=0.0), dict(max_fetch=1)]


def _policy(call: int) -> dict:
    # mostly offload so that the pool fills and evicts, with every rule in between
    return POLICIES[0] if call % 3 else POLICIES[1 + (call // 3) % (len(POLICIES) - 1)]


# decode-kernel settings (the victim list's length at cache creation); each must give the reference's results
KERNEL_SETTINGS = {"default": {}, "no-list": dict(victim_list=0), "list-8": dict(victim_list=8)}


@pytest.mark.gpu
@pytest.mark.parametrize("setting", list(KERNEL_SETTINGS))
@pytest.mark.parametrize("num_slots", [2048, 8192, 18432, 23197])
def test_gpu_lockstep(num_slots, setting):
    create = KERNEL_SETTINGS[setting]
    ref = SlotCache.create(NUM_LAYERS, NUM_EXPERTS, num_slots)
    ker = SlotCache.create(NUM_LAYERS, NUM_EXPERTS, num_slots, device="cuda", **create)
    gen = RouteGen(NUM_LAYERS, NUM_EXPERTS, seed=num_slots, skew=0.6)
    for call in range(STEP_CALLS):
        layer = call % NUM_LAYERS
        # every 10th call is prefill-sized (128 routes): the general kernel; the rest decode-sized
        ids = gen.routes(layer, 16 if call % 10 == 9 else TOKENS, TOP_K)
        a, b = ids.clone(), ids.cuda()
        ensure(ref, layer, a, impl="reference", **_policy(call))
        ensure(ker, layer, b, impl="triton", check_ids=False, **_policy(call))
        assert torch.equal(a, b.cpu()), f"call {call}: routes differ"
        if call % 50 == 0 or call == STEP_CALLS - 1:
            assert_same_state(ref, ker, f"call {call}")
            check_victim_list(ker, f"call {call}")
        if call % 7 == 6:
            cand = gen.candidates(8)
            prefetch_ensure(ref, (layer + 1) % NUM_LAYERS, cand, 3, impl="reference")
            prefetch_ensure(ker, (layer + 1) % NUM_LAYERS, cand.cuda(), 3, impl="triton",
                            check_ids=False)
    assert_same_state(ref, ker, "end of the step-by-step phase")

    layers = [c % NUM_LAYERS for c in range(BACK_TO_BACK_CALLS)]
    routes = torch.stack([gen.routes(l, TOKENS, TOP_K) for l in layers])   # [C, T, K]
    on_gpu = routes.cuda()
    for call, layer in enumerate(layers):
        ensure(ker, layer, on_gpu[call], impl="triton", check_ids=False, **_policy(call))
    torch.cuda.synchronize()                                 # a fault would surface here
    for call, layer in enumerate(layers):
        ensure(ref, layer, routes[call], impl="reference", **_policy(call))
    mismatch = (routes != on_gpu.cpu()).any(dim=(1, 2)).nonzero()
    assert mismatch.numel() == 0, f"routes differ first at call {int(mismatch[0])}"
    assert_same_state(ref, ker, "after the back-to-back run")
    check_invariants(ker)
    check_victim_list(ker, "after the back-to-back run")
    raise_on_error(ker)
    assert int((ker.id_of_slot >= 0).sum()) == num_slots, "the pool never filled"


@pytest.mark.gpu
def test_gpu_graph_replay_sees_live_state():
    """A captured ensure replays against the cache state that earlier replays left."""
    ker = SlotCache.create(4, 16, 8, device="cuda")
    ref = SlotCache.create(4, 16, 8)
    ids = torch.zeros(1, 3, dtype=torch.int64, device="cuda")
    static_in = torch.zeros_like(ids)
    ensure(ker, 1, ids.clone(), fetch_fraction=1.0, impl="triton")       # compile outside capture
    ensure(ref, 1, torch.zeros(1, 3, dtype=torch.int64), fetch_fraction=1.0, impl="reference")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ids.copy_(static_in)
            ensure(ker, 1, ids, fetch_fraction=1.0, impl="triton")
    gen = RouteGen(4, 16, 9)
    for replay in range(30):
        r = gen.routes(1, 1, 3)
        static_in.copy_(r)
        graph.replay()
        ensure(ref, 1, r, fetch_fraction=1.0, impl="reference")
        assert torch.equal(r, ids.cpu()), f"replay {replay}"
    assert_same_state(ref, ker, "after 30 replays")
