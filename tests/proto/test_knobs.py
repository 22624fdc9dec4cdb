"""The FREETOKEN_* knob registry: typed values, precedence, and clear errors."""
from __future__ import annotations

import argparse

import pytest

from ftexpert.proto.knobs import KNOBS, add_cli_flags, read_env, resolve


def test_every_knob_is_an_env_var_a_field_and_a_flag():
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    flags = {a.dest: a.option_strings for a in parser._actions}
    for knob in KNOBS:
        assert knob.env.startswith("FREETOKEN_")
        assert flags[knob.field] == [knob.flag]


def test_env_values_are_typed_and_cli_wins():
    env = {"FREETOKEN_HYBRID_FETCH_ROUND": "stochastic", "FREETOKEN_EVICTION_FREQ_HALF_LIFE": "7"}
    assert read_env(env) == {"fetch_round": "stochastic", "eviction_freq_half_life": 7}
    values = resolve({"fetch_round": "prefer-fetch", "pdl": None}, env)
    assert values["fetch_round"] == "prefer-fetch"          # CLI over environment
    assert values["eviction_freq_half_life"] == 7           # environment over default
    assert values["pdl"] == "auto"                          # default


@pytest.mark.parametrize("env, message", [
    ({"FREETOKEN_HYBRID_FETCH_ROUND": "nearest"}, "choose one of: min-wait, stochastic, prefer-fetch"),
    ({"FREETOKEN_EVICTION_FREQ_HALF_LIFE": "-2"}, "must be >= 0"),
    ({"FREETOKEN_EVICTION_FREQ_HALF_LIFE": "many"}, "is not valid"),
    ({"FREETOKEN_HYBRID_FECTH": "recency"}, "unknown environment variable.*FREETOKEN_HYBRID_FECTH"),
    ({"FREETOKEN_HYBRID_FETCH": "recency"}, "unknown environment variable.*FREETOKEN_HYBRID_FETCH"),      # retired
    ({"FREETOKEN_HYBRID_HANDOFF": "auto"}, "unknown environment variable.*FREETOKEN_HYBRID_HANDOFF"),    # retired
    ({"FREETOKEN_MOE_PREFETCH": "maybe"}, "FREETOKEN_MOE_PREFETCH='maybe' is not valid; choose one of"),
    ({"FREETOKEN_MOE_PREFETCH_BUDGET": "0"}, r"must be an int in \[1, 128\]"),
    ({"FREETOKEN_MOE_PREFETCH_K": "200"}, r"must be an int in \[1, 128\]"),
    ({"FREETOKEN_MOE_PREFETCH_VERIFY": "bytes"}, "FREETOKEN_MOE_PREFETCH_VERIFY='bytes' is not valid"),
    ({"FREETOKEN_MOE_SLOT_AUDIT": "-1"}, "must be >= 0"),
])
def test_bad_environment_gets_a_clear_error(env, message):
    with pytest.raises(ValueError, match=message):
        read_env(env)


def test_the_prefetch_knob_defaults_to_off_and_takes_every_mode():
    assert resolve({}, {})["moe_prefetch"] == "off"
    for mode in ("auto", "off", "measure", "on"):
        assert read_env({"FREETOKEN_MOE_PREFETCH": mode})["moe_prefetch"] == mode
    assert resolve({"moe_prefetch": "off"}, {"FREETOKEN_MOE_PREFETCH": "auto"})["moe_prefetch"] == "off"


def test_the_slot_audit_knob_reads_the_environment_and_the_cli():
    assert read_env({"FREETOKEN_MOE_SLOT_AUDIT": "10"})["moe_slot_audit"] == 10
    assert resolve({"moe_slot_audit": 3}, {})["moe_slot_audit"] == 3

