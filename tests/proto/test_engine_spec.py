"""EngineSpec: one declaration of the engine's flags for every command, resolved once (flag > FREETOKEN_* > default),
refused with the field's name when it cannot be built, and carried whole and typed in the engine link's WELCOME."""
from __future__ import annotations

import argparse

import pytest

from ftexpert.coordinator.cli import build_parser
from ftexpert.proto import engine_messages as em
from ftexpert.proto.engine_spec import EngineSpec, SpecError, add_engine_flags, cache_size_flag, spec_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt-ids", "1"]])
def test_serve_and_generate_declare_the_same_flags_with_the_same_types(command):
    args = build_parser().parse_args([*command, "--moe-cache-size", "0.5", "--max-context-tokens", "64",
                                      "--moe-strategy", "offload", "--expert-format", "int4", "--kv-block-size", "32",
                                      "--kv-cache-gib", "1.5", "--prefix-cache", "off"])
    spec = spec_from_args(args, {})
    assert (spec.moe_cache_size, spec.max_context_tokens, spec.moe_strategy, spec.expert_format) == \
        ("0.5", 64, "offload", "int4-g128")
    assert (spec.kv_block_size, spec.kv_cache_gib, spec.prefix_cache) == (32, 1.5, "off")
    default = spec_from_args(build_parser().parse_args(command), {})
    assert (default.kv_block_size, default.kv_cache_gib, default.prefix_cache) == (None, None, "on")


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
    assert (default.overlap, default.moe_slot_audit, default.pdl, default.moe_prefetch) == (None, 0, "auto", "auto")
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
])
def test_a_spec_that_cannot_be_built_is_refused_naming_the_field(fields, message):
    with pytest.raises(SpecError, match=message):
        EngineSpec(**fields)


def test_prefetch_on_a_slot_cache_is_accepted():
    for strategy in ("offload", "cpu", "hybrid"):
        for mode in ("on", "auto", "measure", "off"):
            assert EngineSpec(moe_strategy=strategy, moe_prefetch=mode).moe_prefetch == mode


def test_auto_prefetch_is_the_default_everywhere_and_nothing_without_a_slot_cache():
    """auto is the spec's, the flags' and the knob's default; resident (no slot cache) takes it as nothing; the flag
    and the environment accept it and still refuse what is not a mode."""
    assert EngineSpec().moe_prefetch == "auto" and EngineSpec(moe_strategy="resident").moe_prefetch == "auto"
    assert spec_from_args(parse("--moe-strategy", "offload"), {}).moe_prefetch == "auto"
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
