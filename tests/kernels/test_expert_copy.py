"""The device-side plan copy (kernels/expert_copy) against its reference, and offload through it."""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels.expert_copy import copy_plan
from tests.conftest import KERNEL_DEVICE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num", [0, 1, 5])
def test_plan_copy_matches_the_reference(dtype, num):
    gen = torch.Generator().manual_seed(num)
    experts, slots_n, row = 12, 9, 3000                      # a row spans several chunks
    # host rows with a padded stride, as the shared-memory store lays them out
    backing = torch.randn(experts, row + 64, generator=gen).to(dtype)
    if KERNEL_DEVICE == "cuda":
        backing = backing.pin_memory()                       # the kernel reads host rows through their mapping
    host = backing[:, :row]
    plan_dst = torch.randperm(slots_n, generator=gen)[:6].to(torch.int32)
    plan_src = torch.randperm(experts, generator=gen)[:6].to(torch.int32)
    count = torch.tensor([num], dtype=torch.int32)
    ref = torch.randn(slots_n, row, generator=gen).to(dtype)
    ker = ref.clone().to(KERNEL_DEVICE)
    copy_plan(ref, host, plan_dst, plan_src, count, max_copies=6, impl="reference")
    copy_plan(ker, host, plan_dst.to(KERNEL_DEVICE), plan_src.to(KERNEL_DEVICE),
              count.to(KERNEL_DEVICE), max_copies=6, impl="triton", chunks=4)
    assert torch.equal(ref.view(torch.int16), ker.cpu().view(torch.int16))   # bit for bit
    for i in range(num):                                     # and the reference did the copy
        assert torch.equal(ref[plan_dst[i]], host[plan_src[i]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [(0, 1800), (1800, 3000), (1003, 1004), (700, 700)])
def test_plan_copy_of_a_column_range_moves_those_words_only(dtype, cols):
    # the two-part copy (w13, then w2) of an expert row: each part lands in full, nothing else is touched
    gen = torch.Generator().manual_seed(cols[0])
    experts, slots_n, row = 7, 6, 3000
    host = torch.randn(experts, row + 40, generator=gen).to(dtype)
    if KERNEL_DEVICE == "cuda":
        host = host.pin_memory()                             # the kernel reads host rows through their mapping
    host = host[:, :row]
    dst = torch.tensor([4, 1, 3], dtype=torch.int32)
    src = torch.tensor([6, 0, 2], dtype=torch.int32)
    before = torch.randn(slots_n, row, generator=gen).to(dtype)
    ker = before.clone().to(KERNEL_DEVICE)
    ref = before.clone()
    count = torch.tensor([2], dtype=torch.int32)            # the third entry is past the plan's length
    copy_plan(ref, host, dst, src, count, max_copies=3, impl="reference", cols=cols)
    copy_plan(ker, host, dst.to(KERNEL_DEVICE), src.to(KERNEL_DEVICE), count.to(KERNEL_DEVICE), max_copies=3,
              impl="triton", chunks=4, block_words=256, cols=cols)
    assert torch.equal(ref.view(torch.int16), ker.cpu().view(torch.int16))
    lo, hi = cols
    expected = before.clone()
    for d, e in zip(dst[:2].tolist(), src[:2].tolist()):
        expected[d, lo:hi] = host[e, lo:hi]
    assert torch.equal(ref.view(torch.int16), expected.view(torch.int16))


def test_plan_copy_errors():
    with pytest.raises(ValueError, match="share dtype and row size"):
        copy_plan(torch.zeros(2, 4), torch.zeros(2, 5), torch.zeros(1, dtype=torch.int32),
                  torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), max_copies=1)
    with pytest.raises(ValueError, match="2- or 4-byte"):
        copy_plan(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64),
                  torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                  torch.zeros(1, dtype=torch.int32), max_copies=1)

    with pytest.raises(ValueError, match="cols"):
        copy_plan(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(1, dtype=torch.int32),
                  torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), max_copies=1, cols=(3, 5))
    dev = {"device": KERNEL_DEVICE}                       # on a GPU the device check comes first
    with pytest.raises(ValueError, match="num_warps 3 one of 1, 2, 4, 8, 16"):
        copy_plan(torch.zeros(2, 4, **dev), torch.zeros(2, 4), torch.zeros(1, dtype=torch.int32, **dev),
                  torch.zeros(1, dtype=torch.int32, **dev), torch.zeros(1, dtype=torch.int32, **dev), max_copies=1,
                  impl="triton", num_warps=3)


@pytest.mark.parametrize("chunks", [1, 3])
def test_plan_copy_of_rows_that_are_not_a_multiple_of_the_block(chunks):
    # Pinned, 16-byte aligned host rows on a GPU (the vector path); the last block of each chunk is masked.
    gen = torch.Generator().manual_seed(chunks)
    experts, row = 6, 8200                                   # not a multiple of the 256-word block
    host = torch.randn(experts, row, generator=gen).to(torch.bfloat16)
    if KERNEL_DEVICE == "cuda":
        host = host.pin_memory()
    dst = torch.tensor([2, 0, 4], dtype=torch.int32)
    src = torch.tensor([5, 1, 3], dtype=torch.int32)
    slots = torch.zeros(5, row, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    copy_plan(slots, host, dst.to(KERNEL_DEVICE), src.to(KERNEL_DEVICE),
              torch.tensor([3], dtype=torch.int32, device=KERNEL_DEVICE), max_copies=3, impl="triton",
              chunks=chunks, block_words=256)
    got = slots.cpu()
    for d, e in zip(dst.tolist(), src.tolist()):
        assert torch.equal(got[d].view(torch.int16), host[e].view(torch.int16))
    assert not got[1].any() and not got[3].any()


@pytest.mark.gpu
def test_gpu_offload_with_the_copy_kernel_runs_in_graphs_and_matches_resident(tmp_path, monkeypatch,
                                                                             no_tf32):
    from ftexpert.gpu_worker.engine import SamplingParams
    from tests.built_engines import build
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    prompts = [[5, 17, 42, 99], [3, 250, 7]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    conf = dict(device="cuda", max_running_requests=2, max_context_tokens=128)
    resident = build(**conf).engine.generate(prompts, params)
    loaded = build(moe_strategy="offload", moe_cache_size=9, **conf)
    try:
        engine = loaded.engine
        assert engine.generate(prompts, params) == resident
        assert engine.graphs.replays > 0, "offload decode did not run in CUDA graphs"
        stats = loaded.experts.refresh_stats()
        assert stats.fetched > 9 and stats.distinct_misses >= stats.fetched
        # the decode copies are timed by CUDA events inside the graphs
        assert engine.stats.copy_time_s_total > 0
    finally:
        loaded.close()
