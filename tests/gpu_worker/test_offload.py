"""The `offload` backend: a slot pool fed from the host expert store, lossless against `resident`."""
from __future__ import annotations

import json
import os

import pytest
import torch

from ftexpert.coordinator.cli import main
from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.backends.offload import resolve_cache_slots
from tests.built_engines import build, build_with_resources, engine_of

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8]


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def assert_slots_hold_their_experts(backend) -> None:
    """Every expert the slot cache maps to a slot has its host bytes in that slot (the tiny model's
    tokens barely depend on expert outputs, so equal tokens alone would not catch stale slots)."""
    for layer in range(backend.num_layers):
        slots = backend.cache.slot_for_id[layer].cpu()
        for expert in (slots >= 0).nonzero().reshape(-1).tolist():
            got = backend.slots[int(slots[expert])].cpu()
            assert torch.equal(got, backend.host.layers[layer][expert]), \
                f"layer {layer} expert {expert}: its slot does not hold its weights"


LONG = [(7 * i + 3) % 300 for i in range(40)]    # 32-token chunks route 64 pairs: the prefill (DMA) path


def _build(device: str = "cpu", **fields):
    return build(device=device, max_running_requests=2, max_context_tokens=128, **fields)


def greedy_tokens(built, n: int = 24, prompts=(PROMPT,), chunk: int = 4) -> list[list[int]]:
    """Greedy tokens; prefill chunks of `chunk` tokens (4: every call decode-sized, the copy kernel's path)."""
    engine = engine_of(built, max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=chunk)
    return engine.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("cache_size, per_layer", [(8, False), (13, False), ("0.5", False),
                                                   ("1.0", False), (32, True)])
def test_offload_gives_the_resident_tokens(cache_size, per_layer):
    """Decode steps copy by the copy kernel (its reference on the CPU), the long prompt's 32-token prefill chunks
    by the DMA path with the next layer prefetched; the tokens are resident's either way."""
    prompts = (PROMPT, LONG)
    resident = greedy_tokens(_build(), prompts=prompts, chunk=32)
    loaded = _build(moe_strategy="offload", moe_cache_size=cache_size, moe_cache_per_layer=per_layer)
    backend = loaded.experts
    assert backend.cache.per_layer == per_layer
    wrong = _check_each_layer_against_host_weights(backend, "cpu")
    try:
        assert greedy_tokens(loaded, prompts=prompts, chunk=32) == resident
        assert not wrong, f"MoE outputs that disagree with the host weights: {wrong[:5]}"
        assert_slots_hold_their_experts(backend)
        stats = backend.refresh_stats()
        assert backend._host_counts[2] > 0 and stats.calls > backend._host_counts[2], "both copy paths ran"
        assert stats.fetched > 0 and stats.fetched - stats.prefetched <= stats.distinct_misses
        total = backend.num_layers * backend.num_experts
        if backend.cache.total_slots < total:
            # a pool smaller than the model must have evicted: more fetches than slots
            assert stats.fetched > backend.cache.total_slots
        else:
            assert stats.fetched <= total, "a pool that holds every expert fetches each once"
    finally:
        backend.close()


def test_the_store_is_one_shared_segment_unlinked_on_close():
    backend = _build(moe_strategy="offload", moe_cache_size=16).experts
    path = f"/dev/shm/{backend.host.store.name}"
    assert os.path.exists(path)
    experts_bytes = backend.num_layers * backend.num_experts * backend.layout.expert_nbytes
    assert backend.host.nbytes >= experts_bytes
    backend.close()
    assert not os.path.exists(path), "the creator must unlink the shared-memory store"


@pytest.mark.parametrize("size, message", [
    (7, "at least 8 slots"), ("1.5", r"fraction must be in \(0, 1\]"), ("0.01", "at least 8 slots"),
])
def test_cache_size_errors(size, message):
    with pytest.raises(ValueError, match=message):
        resolve_cache_slots(size, 4, 8)


def test_cache_size_forms():
    assert resolve_cache_slots(None, 48, 128) == round(0.25 * 48 * 128)
    assert resolve_cache_slots("0.1", 48, 128) == 614
    assert resolve_cache_slots("700", 48, 128) == 700
    assert resolve_cache_slots(6144, 48, 128, per_layer=True) == 128
    with pytest.raises(ValueError, match="at least 128 slots per layer"):
        resolve_cache_slots(700, 48, 128, per_layer=True)


def test_ft_generate_offload_matches_resident(capsys):
    argv = ["generate", "--prompt-ids", "5,17,42,99", "--max-new-tokens", "12", "--ignore-eos",
            "--device", "cpu", "--json"]
    assert main(argv) == 0
    resident = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(argv + ["--moe-strategy", "offload", "--moe-cache-size", "9"]) == 0
    offload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offload["token_ids"] == resident["token_ids"] and offload["moe_strategy"] == "offload"


def test_the_retired_copy_flags_are_refused():
    """The copy modes and the prefill prefetch switch are gone: their flags are refused, their knobs unknown."""
    import argparse

    from ftexpert.coordinator.cli import build_parser
    from ftexpert.gpu_worker.worker_cli import add_arguments
    from ftexpert.proto.knobs import KNOBS_BY_FIELD
    worker = argparse.ArgumentParser()
    add_arguments(worker)
    for flag in ("--offload-copy", "--prefill-prefetch"):
        for parser, argv in ((build_parser(), ["generate", flag, "on"]), (build_parser(), ["serve", flag, "on"]),
                             (worker, [flag, "on"])):
            with pytest.raises(SystemExit):
                parser.parse_args(argv)
    assert "offload_copy" not in KNOBS_BY_FIELD and "prefill_prefetch" not in KNOBS_BY_FIELD


def test_ft_generate_offload_cache_too_small(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt-ids", "5,17", "--max-new-tokens", "2", "--device", "cpu",
                 "--moe-strategy", "offload", "--moe-cache-size", "3"]) == 2
    assert "at least 8 slots" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_offload_matches_resident_on_the_gpu():
    prompts = (PROMPT, PROMPT[:5])
    resident = greedy_tokens(_build("cuda"), n=32, prompts=prompts)
    loaded = _build("cuda", moe_strategy="offload", moe_cache_size=9)
    try:
        assert greedy_tokens(loaded, n=32, prompts=prompts) == resident
        assert loaded.experts.stats.fetched > 9
        assert loaded.experts.collect_copy_time() > 0
    finally:
        loaded.close()
    assert torch.cuda.is_available()


def test_decode_copies_count_on_the_device_and_stay_lossless():
    """Decode-sized calls (every call with 4-token chunks) copy with no plan readback: nothing is counted on the
    host per call, the counters live on the device (the engine folds them in after each step), and each distinct
    miss is fetched once."""
    prompts = (PROMPT, PROMPT[3:9])
    resident = greedy_tokens(_build(), prompts=prompts)
    loaded = _build(moe_strategy="offload", moe_cache_size=10)
    b = loaded.experts
    calls = [0]
    forward = b.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    b.forward = counting
    try:
        assert greedy_tokens(loaded, prompts=prompts) == resident
        assert b._host_counts == [0, 0, 0], "decode copies must not count on the host per call"
        b.refresh_stats()
        assert b.stats.calls == calls[0] > 0
        assert b.stats.fetched == b.stats.distinct_misses > 10
        assert b.collect_copy_time() > 0, "the reference copy's host time"
        assert not b.graph_safe(4), "graphs need CUDA"
    finally:
        b.close()


@pytest.mark.parametrize("chunk", [4, 32])
def test_offload_reports_hits_misses_and_fetches_to_the_engine_stats(chunk):
    """The offload backend's counters reach EngineStats (and so /metrics and GetStats): per layer call, hits +
    misses = the distinct experts routed (counted here from the router's ids), misses and fetches equal the
    backend's own, and the metrics' hit ratio is theirs."""
    from ftexpert.coordinator.metrics import expert_figures
    loaded = _build(moe_strategy="offload", moe_cache_size=10)
    backend = loaded.experts
    distinct = [0]
    forward = backend.forward

    def counting_forward(layer_idx, x, topk_ids, topk_weights, partials=False):    # (offload returns the sum)
        distinct[0] += int(torch.unique(topk_ids[topk_ids >= 0]).numel())
        return forward(layer_idx, x, topk_ids, topk_weights)

    backend.forward = counting_forward
    engine = engine_of(loaded, prefill_chunk_tokens=chunk)
    try:
        engine.generate([list(PROMPT), LONG], SamplingParams(max_new_tokens=12, ignore_eos=True))
        s = engine.stats
        backend.refresh_stats()
        assert s.expert_misses_total == backend.stats.distinct_misses > 0
        assert s.experts_fetched_total == backend.stats.fetched > 0
        assert s.copy_bytes_total == backend.stats.fetched * backend.expert_nbytes()
        assert s.copy_time_s_total == backend.collect_copy_time() > 0
        assert s.expert_hits_total > 0 and s.expert_hits_total + s.expert_misses_total == distinct[0]
        figures = expert_figures(s.as_dict())
        assert figures["expert_hit_rate"] == pytest.approx(s.expert_hits_total / distinct[0])
        assert figures["experts_fetched_total"] == backend.stats.fetched
    finally:
        backend.close()


def _freq_weight_case(device: str) -> None:
    """The frequency-weighted eviction key (FREETOKEN_EVICTION_FREQ_WEIGHT) changes which experts stay, never the
    tokens: greedy tokens equal resident's, every mapped slot holds its expert, routes are counted; on the tiny
    model's routing it keeps more than LRU does (fewer misses)."""
    prompts = (PROMPT, PROMPT[3:9])
    resident = greedy_tokens(_build(device), prompts=prompts)
    misses = {}
    for weight in (0, 64):
        loaded = _build(device, moe_strategy="offload", moe_cache_size=10, eviction_freq_weight=weight)
        backend = loaded.experts
        try:
            assert backend.cache.freq_weight == weight
            assert greedy_tokens(loaded, prompts=prompts) == resident
            assert_slots_hold_their_experts(backend)
            counted = int(backend.cache.expert_count.sum())
            assert (counted > 0) == (weight > 0)
            misses[weight] = backend.refresh_stats().distinct_misses
        finally:
            backend.close()
    assert misses[64] < misses[0], misses


def test_frequency_weighted_eviction_is_lossless():
    _freq_weight_case("cpu")


@pytest.mark.gpu
def test_gpu_frequency_weighted_eviction_is_lossless():
    _freq_weight_case("cuda")


def test_eviction_freq_weight_travels_from_the_cli_to_the_backend(monkeypatch, capsys):
    """The eviction knobs are resolved once by the CLI (flag > FREETOKEN_* > default) and passed down as arguments;
    the backend reads no environment."""
    from ftexpert.gpu_worker.assembly import build
    monkeypatch.setenv("FREETOKEN_EVICTION_FREQ_WEIGHT", "32")
    loaded = load_model(device="cpu", moe_strategy="offload", moe_cache_size=32)
    try:
        assert (loaded.model.experts.cache.freq_weight, loaded.model.experts.cache.freq_half_life) == (0, 3072)
    finally:
        loaded.model.experts.close()
    seen = []

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        seen.append((kwargs["freq_weight"], kwargs["freq_half_life"]))
        raise Stop

    monkeypatch.setattr(build, "make_attached_expert_backend", capture)
    monkeypatch.setenv("FREETOKEN_EVICTION_FREQ_HALF_LIFE", "0")
    for flags, want in (([], (32, 0)), (["--eviction-freq-weight", "7", "--eviction-freq-half-life", "96"], (7, 96))):
        with pytest.raises(Stop):
            main(["generate", "--preset", "tiny", "--moe-strategy", "offload", "--moe-cache-size", "32", "--prompt-ids", "1,2",
                  "--max-new-tokens", "1", "--device", "cpu", *flags])
    assert seen == [(32, 0), (7, 96)]                      # environment over default, flag over environment
    monkeypatch.setenv("FREETOKEN_EVICTION_FREQ_WEIGHT", "5000")
    assert main(["generate", "--preset", "tiny", "--moe-strategy", "offload", "--prompt-ids", "1", "--device", "cpu"]) != 0
    assert "must be an int in [0, 1024]" in capsys.readouterr().err


def _check_each_layer_against_host_weights(backend, device: str) -> list:
    """Wrap backend.forward: each call's output is compared with the same FFN over a resident copy
    of the host weights (the tiny model's tokens hardly depend on expert outputs, and at the end of
    a run every copy has landed, so only this catches a GEMM that read a slot too early).
    Returns the list that collects (layer, relative error) of calls that disagree."""
    from ftexpert.gpu_worker.checkpoint.expert_layout import unpack_experts
    from ftexpert.gpu_worker.backends.expert_compute import expert_ffn, pick_mode
    weights = [unpack_experts(backend.host.layers[layer].to(device), backend.layout)
               for layer in range(backend.num_layers)]
    wrong = []
    forward = backend.forward

    def checked(layer, x, topk_ids, topk_weights, partials=False):    # (offload returns the sum)
        out = forward(layer, x, topk_ids, topk_weights)
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            return out          # a decode step being captured: nothing can be read back inside it
        mode = pick_mode(backend.mode, backend.on_cuda, topk_ids.numel(), backend.gather_max_pairs)
        ref = expert_ffn(mode, x, topk_ids, topk_weights, *weights[layer], kernel_impl=backend.kernel_impl)
        err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12))
        if err > 1e-2:
            wrong.append((layer, err))
        return out

    backend.forward = checked
    return wrong


def _prefill_prefetch_case(device: str, monkeypatch):
    """Tokens of a 40-token prompt (32-token prefill chunks, the DMA path) with the next layer's experts prefetched,
    and, as the baseline, with the prefetch patched out."""
    from ftexpert.gpu_worker.backends.offload import offload_experts

    def run(built):
        engine = engine_of(built, max_running_requests=1, prefill_chunk_tokens=32)
        return engine.generate([LONG], SamplingParams(max_new_tokens=8, ignore_eos=True))

    want = run(_build(device))
    stats = {}
    for prefetch in (True, False):
        if not prefetch:
            monkeypatch.setattr(offload_experts, "prefill_prefetch_layer", lambda *a: None)
        loaded = _build(device, moe_strategy="offload", moe_cache_size=32)
        backend = loaded.experts
        wrong = _check_each_layer_against_host_weights(backend, device)
        try:
            assert run(loaded) == want
            assert not wrong, f"MoE outputs that disagree with the host weights: {wrong[:5]}"
            assert_slots_hold_their_experts(backend)
            assert not backend.slot_pool.prefetched, "a layer did not wait for the experts prefetched for it"
            stats[prefetch] = backend.refresh_stats()
        finally:
            backend.close()
    on, off = stats[True], stats[False]
    assert on.prefetched > 0 and off.prefetched == 0
    assert on.distinct_misses < off.distinct_misses, "prefetched experts should be hits"


def test_prefill_streams_the_next_layers_experts_and_stays_lossless(monkeypatch):
    """A prefill chunk that routes to most experts prefetches the next layer's experts behind its own
    copies; tokens equal resident's, and the next layers then miss less."""
    _prefill_prefetch_case("cpu", monkeypatch)


@pytest.mark.gpu
def test_gpu_prefill_prefetch_is_lossless_and_lands_before_use(monkeypatch):
    """The same on the GPU, where the prefetch copies run on the copy stream behind the layer's own
    and the next layer waits on their event: a missing wait would show as stale slot bytes or tokens."""
    _prefill_prefetch_case("cuda", monkeypatch)


def _fail_once(monkeypatch, obj, method: str, at_call: int) -> list[int]:
    """Make obj.<method> raise on its at_call-th call (counting from 1), after ensure has mapped the slots."""
    real, calls = getattr(obj, method), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected failure after ensure")
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, method, failing)
    return calls


@pytest.mark.parametrize("strategy, chunk", [("offload", 4), ("offload", 32), ("hybrid", 4)])
def test_a_call_that_raises_after_ensure_leaves_no_slot_mapped_without_its_bytes(monkeypatch, strategy, chunk):
    """A layer call that raises between `ensure` (slots mapped) and its copies must not leave those slots mapped:
    the next request would read them as hits. The backend empties its cache; the next generation equals resident's
    and every mapped slot holds its expert."""
    prompts = (PROMPT,) if chunk == 4 else (LONG,)
    resident = greedy_tokens(_build(), prompts=prompts, chunk=chunk)
    if strategy == "hybrid":
        from ftexpert.gpu_worker.backends.hybrid import HybridOptions
        loaded = build_with_resources("hybrid", cache_size="1.0", num_workers=1, worker_args=("--threads", "1"),
                                      max_context_tokens=128,                                 # no eviction hides it
                                      hybrid=HybridOptions(fetch_fraction=0.5, cpu_deadline_s=20.0))
    else:
        loaded = _build(moe_strategy=strategy, moe_cache_size="1.0")   # no eviction hides it
    backend = loaded.experts
    try:
        # offload copies decode-sized calls through its DecodeCopy, prefill chunks through copy_missing; hybrid
        # through its host path's _copy: fail the copies of the 3rd layer call
        obj, method = ((backend.host_path, "_copy") if strategy == "hybrid" else (backend.copy, "run") if chunk == 4
                       else (backend, "copy_missing"))
        calls = _fail_once(monkeypatch, obj, method, at_call=3)
        with pytest.raises(RuntimeError, match="injected failure"):
            greedy_tokens(loaded, prompts=prompts, chunk=chunk)
        assert calls[0] == 3 and backend.stats.resets_after_error == 1
        assert int((backend.cache.slot_for_id >= 0).sum()) == 0, "the cache was not emptied"
        assert greedy_tokens(loaded, prompts=prompts, chunk=chunk) == resident
        assert_slots_hold_their_experts(backend)
        assert backend.stats.resets_after_error == 1
    finally:
        backend.close()
