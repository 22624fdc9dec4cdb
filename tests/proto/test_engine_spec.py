"""EngineSpec: one declaration of the engine's flags for every command, resolved once (flag > FREETOKEN_* > default),
refused with the field's name when it cannot be built, and carried whole and typed in the engine link's WELCOME."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from ftexpert.coordinator.cli import build_parser
from ftexpert.proto import engine_messages as em
from ftexpert.proto.engine_spec import (ATTENTION_BACKENDS, DENSE_LINEARS, ENGINE_FIELDS, EXPERT_COMPUTE_MODES,
                                        EXPERT_FIELDS, MODEL_FIELDS, EngineSpec, SpecError, add_engine_flags,
                                        cache_size_flag, routing_flag, spec_from_args)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt-ids", "1"]])
def test_serve_and_generate_declare_the_same_flags_with_the_same_types(command):
    args = build_parser().parse_args([*command, "--moe-cache-size", "0.5", "--max-context-tokens", "64",
                                      "--moe-strategy", "offload", "--expert-format", "int4", "--kv-block-size", "32",
                                      "--kv-cache-gib", "1.5", "--prefix-cache", "off", "--state-checkpoints", "3"])
    spec = spec_from_args(args, {})
    assert (spec.moe_cache_size, spec.max_context_tokens, spec.moe_strategy, spec.expert_format) == \
        ("0.5", 64, "offload", "int4-g128")
    assert (spec.kv_block_size, spec.kv_cache_gib, spec.prefix_cache, spec.state_checkpoints) == (32, 1.5, "off", 3)
    default = spec_from_args(build_parser().parse_args(command), {})
    assert (default.kv_block_size, default.kv_cache_gib, default.prefix_cache, default.state_checkpoints) == \
        (None, None, "on", None)
    with pytest.raises(SystemExit):                    # refused at parse time, naming the flag (argparse's exit 2)
        build_parser().parse_args([*command, "--state-checkpoints", "-1"])


@pytest.mark.parametrize("raw, text", [("256", "256"), ("1", "1"), ("0.25", "0.25"), ("1.0", "1.0"), (" 8 ", "8")])
def test_the_cache_size_is_a_count_or_a_fraction(raw, text):
    assert cache_size_flag(raw) == text


@pytest.mark.parametrize("raw", ["0", "-3", "1.5", "0.0", "many", "2.0"])
def test_a_bad_cache_size_is_refused(raw):
    with pytest.raises(argparse.ArgumentTypeError, match="slot count"):
        cache_size_flag(raw)


def test_flags_over_the_environment_over_the_defaults():
    env = {"FREETOKEN_OVERLAP_DECODE": "off", "FREETOKEN_MOE_SLOT_AUDIT": "3", "FREETOKEN_PDL": "on"}
    spec = spec_from_args(parse("--pdl", "off"), env)
    assert (spec.overlap_decode, spec.overlap, spec.moe_slot_audit, spec.pdl) == ("off", False, 3, "off")
    default = spec_from_args(parse(), {})
    assert (default.overlap, default.moe_slot_audit, default.pdl, default.moe_prefetch) == (None, 0, "auto", "off")
    assert spec_from_args(parse("--model", "rel/dir"), {}).model.endswith("/rel/dir")       # made absolute
    with pytest.raises(ValueError, match="FREETOKEN_PDL='sometimes'"):
        spec_from_args(parse(), {"FREETOKEN_PDL": "sometimes"})


@pytest.mark.parametrize("fields, message", [
    ({"moe_strategy": "gpu"}, "moe_strategy='gpu' is not one of"),
    ({"max_running_requests": 0}, "max_running_requests=0 must be >= 1"),
    ({"max_context_tokens": 0}, "max_context_tokens=0 must be >= 1"),
    ({"num_cpu_workers": -1}, "num_cpu_workers=-1 must be >= 0"),
    ({"moe_cache_size": "0"}, "moe_cache_size: expected a slot count"),
    ({"expert_format": "int5"}, "expert_format='int5'"),
    ({"moe_prefetch": "on"}, "needs a slot cache"),                 # resident has none
    ({"moe_prefetch": "measure"}, "needs a slot cache"),
    ({"moe_strategy": "offload", "moe_prefetch": "sometimes"}, "moe_prefetch='sometimes' is not one of auto"),
    ({"moe_prefetch_verify": "meta"}, "needs a slot cache"),
    ({"kv_block_size": 0}, "kv_block_size=0 must be >= 1"),
    ({"kv_cache_gib": 0.0}, "kv_cache_gib=0.0 must be > 0"),
    ({"prefix_cache": "maybe"}, "prefix_cache='maybe' is not one of on, off"),
    ({"state_checkpoints": -1}, "state_checkpoints=-1 must be >= 0"),
])
def test_a_spec_that_cannot_be_built_is_refused_naming_the_field(fields, message):
    with pytest.raises(SpecError, match=message):
        EngineSpec(**fields)


def test_prefetch_on_a_slot_cache_is_accepted():
    for strategy in ("offload", "cpu", "hybrid"):
        for mode in ("on", "auto", "measure", "off"):
            assert EngineSpec(moe_strategy=strategy, moe_prefetch=mode).moe_prefetch == mode


def test_prefetch_is_off_by_default_everywhere_and_auto_is_nothing_without_a_slot_cache():
    """off is the spec's, the flags' and the knob's default (docs/PREFETCH.md: until auto is measured no slower);
    resident (no slot cache) takes auto as nothing; the flag and the environment accept every mode and still refuse
    what is not one."""
    assert EngineSpec().moe_prefetch == "off"
    assert EngineSpec(moe_strategy="resident", moe_prefetch="auto").moe_prefetch == "auto"
    assert spec_from_args(parse("--moe-strategy", "offload"), {}).moe_prefetch == "off"
    assert spec_from_args(parse("--moe-strategy", "offload", "--moe-prefetch", "auto"), {}).moe_prefetch == "auto"
    assert spec_from_args(parse("--moe-strategy", "offload", "--moe-prefetch", "off"), {}).moe_prefetch == "off"
    assert spec_from_args(parse("--moe-strategy", "hybrid"), {"FREETOKEN_MOE_PREFETCH": "on"}).moe_prefetch == "on"
    assert spec_from_args(parse(), {"FREETOKEN_MOE_PREFETCH": "auto"}).moe_prefetch == "auto"
    with pytest.raises(SystemExit):
        parse("--moe-prefetch", "sometimes")
    with pytest.raises(ValueError, match="FREETOKEN_MOE_PREFETCH='always' is not valid"):
        spec_from_args(parse(), {"FREETOKEN_MOE_PREFETCH": "always"})


def test_welcome_carries_the_spec_whole_and_refuses_a_bad_one():
    spec = EngineSpec(model="/m", moe_strategy="hybrid", moe_cache_size="0.25", num_cpu_workers=2,
                      reserve_cpus="0", max_context_tokens=4096, moe_prefetch="on", overlap_decode="off")
    welcome = em.Welcome(3, 99, "ft-experts", ["ft-experts.cpu0"], 1.0, 10.0, spec)
    assert em.decode(em.encode(welcome)) == welcome
    assert EngineSpec(**spec.to_wire()) == spec
    kind, payload = em.encode(welcome)
    import msgpack
    bad = msgpack.unpackb(payload, raw=False)
    bad["spec"]["moe_strategy"] = "gpu"
    with pytest.raises(em.MessageError, match="moe_strategy='gpu'"):
        em.decode([kind, msgpack.packb(bad, use_bin_type=True)])
    bad["spec"] = {**spec.to_wire(), "fetch_everything": True}       # a field this version does not know
    with pytest.raises(em.MessageError, match="unknown field"):
        em.decode([kind, msgpack.packb(bad, use_bin_type=True)])


@pytest.mark.parametrize("fields, message", [
    ({"cuda_graphs": "maybe"}, "cuda_graphs='maybe' is not one of on, off"),
    ({"attention_backend": "flash"}, "attention_backend='flash' is not one of auto, sdpa, triton"),
    ({"expert_compute": "fast"}, "expert_compute='fast' is not one of auto, grouped, gemv"),
    ({"expert_copy": "half"}, "expert_copy='half' is not one of split, whole"),
    ({"fused_kernels": "yes"}, "fused_kernels='yes' is not one of auto, on, off"),
    ({"dense_linear": "cublas"}, "dense_linear='cublas' is not one of auto, gemv, torch"),
    ({"overlap_decode": "always"}, "overlap_decode='always' is not one of auto, on, off"),
    ({"routing": "uniform"}, "routing='uniform': expected model, zipf"),
    ({"routing": "zipf:-1"}, "routing='zipf:-1'"),
    ({"routing": "trace:"}, "routing='trace:'"),
    ({"moe_cache_per_layer": "yes", "moe_strategy": "offload"}, "moe_cache_per_layer='yes' must be True or False"),
    ({"moe_cache_per_layer": True}, "moe_cache_per_layer: per-layer slot pools need a slot cache"),
])
def test_the_forward_and_engine_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(SpecError, match=message):
        EngineSpec(**fields)


def test_the_forward_and_engine_flags_reach_the_spec():
    spec = spec_from_args(parse("--cuda-graphs", "off", "--attention-backend", "sdpa", "--expert-compute", "gemv",
                                "--expert-copy", "whole", "--fused-kernels", "off", "--dense-linear", "torch",
                                "--routing", "trace:rel/r.trace", "--moe-strategy", "offload",
                                "--moe-cache-per-layer"), {})
    assert (spec.cuda_graphs, spec.attention_backend, spec.expert_compute, spec.expert_copy, spec.fused_kernels,
            spec.fused, spec.dense_linear, spec.moe_cache_per_layer) == \
        ("off", "sdpa", "gemv", "whole", "off", False, "torch", True)
    assert spec.routing.startswith("trace:/") and spec.routing.endswith("/rel/r.trace")     # made absolute
    default = spec_from_args(parse(), {})
    assert (default.cuda_graphs, default.attention_backend, default.expert_compute, default.expert_copy,
            default.fused, default.dense_linear, default.routing, default.moe_cache_per_layer) == \
        ("on", "auto", "auto", "split", None, "auto", "model", False)
    for bad in (["--routing", "uniform"], ["--cuda-graphs", "maybe"], ["--expert-compute", "fast"]):
        with pytest.raises(SystemExit):
            parse(*bad)


@pytest.mark.parametrize("raw", ["model", "zipf", "zipf:1.0", "zipf:0", "trace:/x/y.trace"])
def test_routing_forms(raw):
    assert routing_flag(raw) == raw


def test_every_field_is_in_one_rebuild_group():
    """What a change of each field rebuilds (build.py's hooks): the model, the expert backend, or the engine only."""
    names = [f.name for f in dataclasses.fields(EngineSpec)]
    groups = MODEL_FIELDS + EXPERT_FIELDS + ENGINE_FIELDS
    assert sorted(groups) == sorted(names) and len(set(groups)) == len(groups)
    assert EngineSpec(cuda_graphs="off").differing(EngineSpec(dtype="float32")) == ["dtype", "cuda_graphs"]


def test_the_torch_free_choices_are_their_homes():
    from ftexpert.gpu_worker.backends.expert_compute import MODES
    from ftexpert.gpu_worker.engine.attention import ATTENTION_BACKENDS as ENGINE_BACKENDS
    from ftexpert.gpu_worker.models.model import MoeModel
    assert EXPERT_COMPUTE_MODES == MODES and ATTENTION_BACKENDS == ENGINE_BACKENDS
    assert DENSE_LINEARS == ("auto", *MoeModel.DENSE_LINEARS)


# The wire form of the spec at this engine-link protocol version: a field added, dropped or renamed changes what
# WELCOME carries, so ENGINE_PROTOCOL_VERSION goes up with it (and this list with both).
WIRE_FIELDS = {6: ("model", "preset", "seed_weights", "device", "dtype", "expert_format", "moe_strategy",
                   "moe_cache_size", "moe_cache_per_layer", "num_cpu_workers", "reserve_cpus", "pin_gpu_worker",
                   "eviction_freq_weight", "eviction_freq_half_life", "moe_prefetch", "moe_prefetch_budget",
                   "moe_prefetch_k", "moe_prefetch_verify", "expert_compute", "expert_copy", "fused_kernels",
                   "dense_linear", "routing", "max_running_requests", "max_context_tokens", "prefill_chunk_tokens",
                   "kv_block_size", "kv_cache_gib", "prefix_cache", "overlap_decode", "cuda_graphs", "attention_backend", "moe_slot_audit", "pdl"),
               7: ("model", "preset", "seed_weights", "device", "dtype", "expert_format", "moe_strategy",
                   "moe_cache_size", "moe_cache_per_layer", "num_cpu_workers", "reserve_cpus", "cpu_act_quant", "pin_gpu_worker",
                   "eviction_freq_weight", "eviction_freq_half_life", "moe_prefetch", "moe_prefetch_budget",
                   "moe_prefetch_k", "moe_prefetch_verify", "expert_compute", "expert_copy", "fused_kernels",
                   "dense_linear", "routing", "max_running_requests", "max_context_tokens", "prefill_chunk_tokens",
                   "kv_block_size", "kv_cache_gib", "prefix_cache", "overlap_decode", "cuda_graphs", "attention_backend", "moe_slot_audit", "pdl"),
               8: ("model", "preset", "seed_weights", "device", "dtype", "expert_format", "moe_strategy",
                   "moe_cache_size", "moe_cache_per_layer", "num_cpu_workers", "reserve_cpus", "cpu_act_quant",
                   "pin_gpu_worker", "eviction_freq_weight", "eviction_freq_half_life", "moe_prefetch",
                   "moe_prefetch_budget", "moe_prefetch_k", "moe_prefetch_verify", "expert_compute", "expert_copy",
                   "fused_kernels", "dense_linear", "routing", "max_running_requests", "max_context_tokens",
                   "prefill_chunk_tokens", "kv_block_size", "kv_cache_gib", "prefix_cache", "state_checkpoints",
                   "overlap_decode", "cuda_graphs", "attention_backend", "moe_slot_audit", "pdl")}


def test_a_new_wire_form_bumps_the_protocol_version():
    assert em.ENGINE_PROTOCOL_VERSION in WIRE_FIELDS, "a new protocol version: list its spec fields here"
    assert tuple(EngineSpec().to_wire()) == WIRE_FIELDS[em.ENGINE_PROTOCOL_VERSION], \
        "EngineSpec's wire form changed: bump proto/engine_messages.py ENGINE_PROTOCOL_VERSION"
    spec = EngineSpec(moe_strategy="offload", moe_cache_per_layer=True, routing="zipf:0.5", cuda_graphs="off",
                      expert_copy="whole", fused_kernels="on", dense_linear="torch", attention_backend="sdpa",
                      expert_compute="gemv")
    welcome = em.Welcome(3, 99, "ft-experts", [], 1.0, 10.0, spec)
    assert em.decode(em.encode(welcome)) == welcome
