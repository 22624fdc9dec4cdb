"""GPU smoke tests for the engine (run on the GPU machine: ``pytest -m gpu tests/gpu_worker/test_engine_gpu.py -s``).

- the tiny model on CUDA gives the CPU's greedy tokens (float32, TF32 off), alone and batched;
- transformers parity on CUDA; bf16 runs; seeded sampling is reproducible on CUDA;
- the decode forward captures into a CUDA graph and replays to the eager logits (no host sync inside);
- the qwen3-30b-a3b preset materialises on the GPU quickly without a host copy of the experts.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.attention import PrefillAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.checkpoint.tiny import ensure_tiny_checkpoint
from tests.built_engines import build, engine_of
from tests.gpu_worker.test_models_util import hf_greedy, hf_model, prompt_ids, rel_err, save_hf

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache") / "tiny")


def prompts(vocab):
    return [prompt_ids(n, seed=n, vocab=vocab) for n in (5, 23, 11)]


@pytest.mark.parametrize("expert_compute", ["auto", "grouped", "gemv"])
def test_tiny_cuda_matches_cpu(tiny_dir, expert_compute):
    cpu = build(tiny_dir, max_context_tokens=256)
    gpu = build(tiny_dir, device="cuda", expert_compute=expert_compute, max_context_tokens=256)
    assert gpu.model.device.type == "cuda" and gpu.model.experts.packed[0].is_cuda
    ps = prompts(cpu.cfg.vocab_size)
    expected = cpu.engine.generate(ps, GREEDY)
    got = engine_of(gpu, prefill_chunk_tokens=8).generate(ps, GREEDY)
    assert got == expected
    kv_c = KVCache(cpu.cfg, 1, 64, torch.float32, torch.device("cpu"))
    kv_g = KVCache(gpu.cfg, 1, 64, torch.float32, gpu.device)
    ids = torch.tensor(ps[1])
    lc = cpu.model.forward(ids, torch.arange(len(ids)), PrefillAttention(kv_c, 0, 0, len(ids)))
    lg = gpu.model.forward(ids.cuda(), torch.arange(len(ids)).cuda(), PrefillAttention(kv_g, 0, 0, len(ids)))
    assert rel_err(lg.cpu(), lc) <= 1e-4


def test_transformers_parity_on_cuda(tmp_path):
    hf = hf_model("qwen3", seed=7)
    ours = build(save_hf(hf, tmp_path / "q"), device="cuda", dtype="float32", max_context_tokens=128)
    prompt = prompt_ids(11, seed=4)
    engine = ours.engine
    assert engine.generate([prompt], GREEDY)[0] == hf_greedy(hf, prompt, 32)


def test_bfloat16_and_seeded_sampling_on_cuda(tiny_dir):
    gpu = build(tiny_dir, device="cuda", dtype="bfloat16", max_context_tokens=256)
    assert gpu.model.dtype == torch.bfloat16 and gpu.model.experts.packed[0].dtype == torch.bfloat16
    engine = gpu.engine
    ps = prompts(gpu.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    first = engine.generate(ps, params)
    assert first == engine.generate(ps, params)
    assert all(len(t) == 24 and all(0 <= x < gpu.cfg.vocab_size for x in t) for t in first)


def test_decode_forward_captures_in_a_cuda_graph(tiny_dir):
    gpu = build(tiny_dir, device="cuda", expert_compute="gemv", max_running_requests=3, max_context_tokens=256)
    engine = gpu.engine
    for p in prompts(gpu.cfg.vocab_size):
        engine.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True))
    for _ in range(5):
        engine.step()
    reqs = engine.scheduler.plan().decode
    assert len(reqs) == 3
    inputs = engine.decode_inputs(reqs)
    eager = engine.decode_forward(inputs).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            engine.decode_forward(inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                        # raises on any host sync inside
        static_logits = engine.decode_forward(inputs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(static_logits, eager, rtol=1e-5, atol=1e-5)


def _host_rss_bytes() -> int:
    import psutil
    return psutil.Process(os.getpid()).memory_info().rss


def test_qwen3_30b_preset_materialises_fast_on_the_gpu():
    free_bytes, _ = torch.cuda.mem_get_info()
    if free_bytes < 80 * 2**30:
        pytest.skip(f"needs ~75 GiB of free GPU memory, {free_bytes / 2**30:.0f} GiB free")
    rss0 = _host_rss_bytes()
    t0 = time.perf_counter()
    loaded = build(preset="qwen3-30b-a3b", device="cuda", max_running_requests=4, max_context_tokens=4096)
    load_s = time.perf_counter() - t0
    rss_growth = _host_rss_bytes() - rss0
    experts = loaded.model.experts
    print(f"\nqwen3-30b-a3b preset: {experts.nbytes() / 2**30:.1f} GiB experts on the GPU in {load_s:.1f} s; "
          f"host RSS grew {rss_growth / 2**30:.2f} GiB")
    assert experts.num_layers == 48 and experts.packed[0].shape == (128, 3 * 2048 * 768)
    assert experts.packed[0].dtype == torch.bfloat16 and experts.packed[0].is_cuda
    assert load_s < 120
    assert rss_growth < 4 * 2**30                      # no host copy of the 54 GiB of experts
    engine = loaded.engine
    out = engine.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert all(len(t) == 16 for t in out)
    print(f"decode {engine.stats.decode_tokens_per_s:.1f} tok/s (batch 4, resident, eager)")
    del engine, loaded, experts
    torch.cuda.empty_cache()
