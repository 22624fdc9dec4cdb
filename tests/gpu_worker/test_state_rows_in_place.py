"""engine/state_cache.py's in-place rows of a decode step (`StateRows.recurrent_rows`, beside `conv_rows`): the live
layer of the cache and the step's rows, None for a prefill chunk; the gated delta rule's in-place kernel
(kernels/next_decode gdn_decode_rule; the Triton interpreter without a GPU) over them equals read_recurrent +
the rule + write_recurrent, and keeps the snapshot / restore contract of the CUDA-graph warm-ups and retried
decode steps: a step run again after `restore` gives the same output and state, bit for bit."""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.engine.state_cache import StateCache
from ftexpert.kernels import gated_delta
from ftexpert.kernels import next_decode as kn
from tests.conftest import KERNEL_DEVICE

DEV = torch.device(KERNEL_DEVICE)


def mini_cfg():
    """The 80B preset with 2 key / 4 value linear heads of 8 and 3 of its 4 layers linear."""
    from ftexpert.gpu_worker.checkpoint import presets
    cfg = presets.preset_config("qwen3-next-80b-a3b")
    lin = cfg.linear_attention.__class__(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                         conv_kernel_dim=4)
    return cfg.replace(num_layers=4, layer_types=cfg.layer_types[:4], linear_attention=lin, dtype="float32")


def filled_cache(cfg, seed: int = 0) -> StateCache:
    cache = StateCache(cfg, 5, torch.float32, DEV)
    gen = torch.Generator().manual_seed(seed)
    cache.recurrent.copy_(torch.randn(cache.recurrent.shape, generator=gen))
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    return cache


def step_inputs(T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, 4, 8, generator=gen).to(DEV) for _ in range(3))
    g = -torch.rand(T, 4, generator=gen).to(DEV)
    beta = torch.rand(T, 4, generator=gen).to(DEV)
    return q, k, v, g, beta


def test_recurrent_rows_are_the_live_layer_and_the_steps_rows():
    cache = filled_cache(mini_cfg())
    assert cache.prefill(2, 5).recurrent_rows(1) is None and cache.prefill(2, 5).conv_rows(1) is None
    slots = torch.tensor([3, 1], device=DEV)
    state, rows = cache.decode(slots).recurrent_rows(1)
    assert rows is slots
    assert state.shape == cache.recurrent.shape[1:] and state.data_ptr() == cache.recurrent[1].data_ptr()


def test_in_place_step_equals_read_rule_write_and_restores():
    cfg = mini_cfg()
    layer, slots = 2, torch.tensor([4, 0, 2], device=DEV)
    inputs = step_inputs(3, seed=1)
    # the old path on a twin cache: gather, the rule, scatter
    old = filled_cache(cfg)
    old_rows = old.decode(slots)
    o_old, s_new = gated_delta.recurrent_gated_delta_rule(*(x.unsqueeze(1) for x in inputs),
                                                          old_rows.read_recurrent(layer), impl="reference")
    old_rows.write_recurrent(layer, s_new)
    # in place, after a snapshot (what the CUDA-graph warm-ups and a retried decode step take)
    cache = filled_cache(cfg)
    before = cache.recurrent.clone()
    saved = cache.snapshot(slots)
    o1 = kn.gdn_decode_rule(*inputs, *cache.decode(slots).recurrent_rows(layer), impl="triton")
    after = cache.recurrent.clone()
    torch.testing.assert_close(o1.squeeze(1), o_old.squeeze(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, old.recurrent, rtol=1e-5, atol=1e-5)
    changed = (after != before).flatten(2).any(-1)                 # [layers, rows]
    assert changed[layer, slots].all() and changed.sum() == len(slots)
    cache.restore(slots, saved)
    assert torch.equal(cache.recurrent, before)
    o2 = kn.gdn_decode_rule(*inputs, *cache.decode(slots).recurrent_rows(layer), impl="triton")
    assert torch.equal(o2, o1) and torch.equal(cache.recurrent, after)
