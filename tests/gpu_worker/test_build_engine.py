"""build_engine(spec): the spec's forward and engine fields reach the engine, and the hooks that build over an
earlier build (fresh_engine for another engine over the same model and experts, reuse= for another expert backend
over the same dense weights, Attachment(host=) for a store the caller keeps) refuse what they cannot keep."""
from __future__ import annotations

import os

import pytest

from ftexpert.gpu_worker.api import Attachment, HostExperts, SamplingParams, build_engine
from ftexpert.proto.engine_spec import SpecError
from tests.built_engines import build, engine_of, spec

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11]
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tiny-cache"))


def test_the_spec_reaches_the_engine_the_model_and_the_backend():
    built = build(max_context_tokens=64, max_running_requests=2, prefill_chunk_tokens=4, cuda_graphs="off",
                  attention_backend="sdpa", fused_kernels="on", dense_linear="gemv", routing="zipf:0.5",
                  moe_strategy="offload", moe_cache_size="32", moe_cache_per_layer=True, expert_compute="gemv",
                  expert_copy="whole", eviction_freq_weight=16, moe_prefetch="on", moe_prefetch_budget=2)
    try:
        engine, model, experts = built.engine, built.model, built.experts
        assert (engine.config.cuda_graphs, engine.config.attention_backend, engine.max_context_tokens,
                engine.prefill_chunk_tokens, engine.config.max_running_requests) == (False, "sdpa", 64, 4, 2)
        assert model.fused_kernels and model.dense_linear == "gemv" and model.routing_override.skew == 0.5
        assert model.routing_override.max_positions == 64                      # the table covers the context
        assert (experts.mode, experts.copy.split, experts.cache.per_layer, experts.cache.freq_weight) == \
            ("gemv", False, True, 16)
        assert experts.lookahead.settings.mode == "on" and experts.lookahead.settings.budget == 2
    finally:
        built.close()


def test_fresh_engine_changes_engine_settings_and_refuses_the_rest():
    built = build(max_context_tokens=64)
    first = built.engine
    assert built.fresh_engine() is built.engine is not first and first.prefill_chunk_tokens == 4096
    engine = engine_of(built, max_running_requests=1, prefill_chunk_tokens=5, dense_linear="gemv",
                       routing="zipf:1.0")
    assert engine is built.engine and engine.model is built.model                # the latest engine over the model
    assert (engine.config.max_running_requests, engine.prefill_chunk_tokens) == (1, 5)
    assert built.model.dense_linear == "gemv" and built.model.routing_override is not None      # the shared model's
    assert built.spec.routing == "zipf:1.0"                                                       # ... and its spec
    with pytest.raises(SpecError, match=r"dtype='bfloat16': fresh_engine keeps the built model"):
        engine_of(built, dtype="bfloat16")
    with pytest.raises(SpecError, match=r"moe_strategy='offload'.*reuse=built"):
        engine_of(built, moe_strategy="offload")


def test_reuse_keeps_the_dense_weights_and_closes_the_last_backend():
    """Offload over a store the caller keeps (Attachment(host=)), then another backend over it (reuse=): the dense
    weights are the first build's, each backend closed before the next, the store only by its owner; the tokens
    stay resident's."""
    resident = build(max_context_tokens=64)
    want = resident.engine.generate([PROMPT], GREEDY)
    dense = resident.model.dense
    resident.release_experts()
    assert resident.experts is None and resident.engine is None and resident.model.experts is None
    with pytest.raises(ValueError, match="expert backend was released"):
        resident.fresh_engine()
    host = HostExperts.create_filled(resident.source.experts, pin=False)
    try:
        first = build_engine(spec(max_context_tokens=64, moe_strategy="offload", moe_cache_size="10"),
                             attachment=Attachment(host=host), reuse=resident)
        assert first.model.dense is dense and resident.model is None
        assert first.engine.generate([PROMPT], GREEDY) == want
        backend = first.experts
        second = build_engine(spec(max_context_tokens=64, moe_strategy="offload", moe_cache_size="16",
                                   eviction_freq_weight=64), attachment=Attachment(host=host), reuse=first)
        assert first.model is None and backend.owns_host is False
        assert second.model.dense is dense and second.experts.cache.freq_weight == 64
        assert second.engine.generate([PROMPT], GREEDY) == want
        second.close()
        assert os.path.exists(f"/dev/shm/{host.store.name}")           # the owner's, still open
        with pytest.raises(ValueError, match="handed over"):
            build_engine(spec(max_context_tokens=64), reuse=first)
        with pytest.raises(SpecError, match=r"expert_format='int4-g32': build_engine\(reuse=...\) keeps"):
            build_engine(spec(max_context_tokens=64, expert_format="int4-g32"), reuse=second)
    finally:
        host.close()
    assert not os.path.exists(f"/dev/shm/{host.store.name}")


def test_a_backend_that_owns_its_store_unlinks_it_when_reused_away():
    built = build(max_context_tokens=64, moe_strategy="offload", moe_cache_size="10")
    path = f"/dev/shm/{built.experts.host.store.name}"
    assert os.path.exists(path)
    resident = build_engine(spec(max_context_tokens=64), reuse=built)
    assert not os.path.exists(path) and resident.experts.num_layers == resident.cfg.num_layers
