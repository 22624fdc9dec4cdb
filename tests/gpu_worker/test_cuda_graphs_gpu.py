"""Decode through CUDA graphs gives exactly the eager tokens, and graphs are really replayed."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from tests.built_engines import build, engine_of

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("strategy", ["resident", "offload"])
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_graph_decode_equals_eager(num_prompts, strategy, tmp_path, monkeypatch):
    """Offload too: its decode copies (the copy kernel and its timing events) inside the graphs."""
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    loaded = build(device="cuda", max_running_requests=3, max_context_tokens=256,
                   **({} if strategy == "resident" else dict(moe_strategy="offload", moe_cache_size=9)))
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3][: 3 + i] for i in range(num_prompts)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eager = engine_of(loaded, cuda_graphs="off")
    graphs = engine_of(loaded, cuda_graphs="on")
    try:
        assert eager.generate(prompts, params) == graphs.generate(prompts, params)
        assert graphs.graphs.captures >= 1 and graphs.graphs.replays >= 30
        assert eager.graphs is None
        if strategy == "offload":          # cumulative over both engines; the graphs' copies are timed too
            assert graphs.stats.copy_time_s_total > eager.stats.copy_time_s_total > 0
    finally:
        loaded.close()


def test_graph_decode_in_the_grouped_mode_equals_eager(tmp_path, monkeypatch):
    """The grouped expert mode (bf16 on Hopper+: torch._grouped_mm with its offsets on the device), which `auto`
    takes for decode batches above 32 pairs, captured in the decode graphs: the same tokens as eager."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped mode is captured only where torch._grouped_mm runs (compute capability 9.0+)")
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    loaded = build(device="cuda", dtype="bfloat16", expert_compute="grouped", max_running_requests=4,
                   max_context_tokens=256)
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3] for i in range(4)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eager = engine_of(loaded, cuda_graphs="off")
    graphs = engine_of(loaded, cuda_graphs="on")
    try:
        assert graphs.model.experts.graph_safe(4 * graphs.model.cfg.top_k)
        assert eager.generate(prompts, params) == graphs.generate(prompts, params)
        assert graphs.graphs.captures >= 1 and graphs.graphs.replays >= 30
    finally:
        loaded.close()


def dead_engine_collected_mid_capture() -> tuple[list, list]:
    """Tokens of the tiny model from a first engine, and from a second one whose first graph capture runs automatic
    garbage collection where the first engine (a dead Engine <-> DecodeGraphs cycle holding captured graphs) is due:
    frozen out of the collector until the capture, then unfrozen with thresholds of 1 and a burst of allocations."""
    import gc
    loaded = build(device="cuda", max_running_requests=1, max_context_tokens=128, cuda_graphs="on")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first = loaded.fresh_engine()
    want = first.generate([[1, 2, 3, 4, 5]], params)
    assert first.graphs.captures > 0
    del first                                      # unreachable now, but a cycle: only the collector frees it
    gc.freeze()
    second = loaded.fresh_engine()
    plain_forward, burst = second.decode_forward, []

    def forward(inputs):
        if torch.cuda.is_current_stream_capturing() and not burst:
            gc.unfreeze()
            old = gc.get_threshold()
            gc.set_threshold(1, 1, 1)
            burst.extend([[] for _ in range(5000)])   # automatic collections, where the collector is enabled
            gc.set_threshold(*old)
        return plain_forward(inputs)

    second.decode_forward = forward
    try:
        got = second.generate([[1, 2, 3, 4, 5]], params)
    finally:
        gc.unfreeze()
    assert burst, "the capture ran the burst"
    return want, got


@pytest.mark.gpu
def test_a_dead_engine_collected_during_a_capture_does_not_break_it():
    """No cyclic collection runs while a decode graph is captured (DecodeGraphs._capture): a dead engine's graphs
    destroyed mid-capture would invalidate it (cudaErrorStreamCaptureInvalidated)."""
    want, got = dead_engine_collected_mid_capture()
    assert got == want
