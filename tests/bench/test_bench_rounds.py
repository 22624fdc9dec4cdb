"""bench/bench_hybrid.py --rounds: the variants run in turn, round after round, then one row per variant from
its median round (whole, not figures mixed from several rounds)."""
from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench_hybrid():
    spec = importlib.util.spec_from_file_location("bench_hybrid", os.path.join(REPO, "bench", "bench_hybrid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_median_rounds_picks_one_whole_round_per_variant():
    median_rounds = _bench_hybrid().median_rounds
    by_variant = {
        "hybrid split": [{"decode_tok_s": 60.0, "wait": 1}, {"decode_tok_s": 52.0, "wait": 5},
                                {"decode_tok_s": 63.5, "wait": 0}],
        "hybrid min-wait": [{"decode_tok_s": 55.0, "wait": 4}, {"decode_tok_s": 57.0, "wait": 3}],
    }
    rows = dict(median_rounds(by_variant))
    split = rows["hybrid split (median of 3 rounds)"]
    assert (split["decode_tok_s"], split["wait"]) == (60.0, 1)              # the middle round, all of it
    assert split["rounds_tok_s"] == [60.0, 52.0, 63.5]                     # in the order they ran
    mw = rows["hybrid min-wait (median of 2 rounds)"]
    assert (mw["decode_tok_s"], mw["wait"]) == (57.0, 3)                    # even count: the upper middle
    assert "rounds_tok_s" not in by_variant["hybrid split"][0]      # the rounds' own rows unchanged


def test_freq_weights_cross_every_variant_and_keep_each_backend():
    import argparse
    bench = _bench_hybrid()
    args = argparse.Namespace(extra_fractions="", variants="offload,=hybrid split", freq_weights="0,256",
                              prefetch_budgets="")
    rows = dict(bench.variants(args))
    assert set(rows) == {f"{n} fw{w}" for n in ("offload", "offload whole-copy", "hybrid split") for w in (0, 256)}
    assert rows["offload fw256"] == {"strategy": "offload", "freq_weight": 256}
    assert rows["offload whole-copy fw0"] == {"strategy": "offload", "split_copy": False, "freq_weight": 0}
    hybrid = rows["hybrid split fw256"]
    assert hybrid["strategy"] == "hybrid" and hybrid["freq_weight"] == 256
    args.freq_weights = ""
    assert all("freq_weight" not in (p or {}) for _, p in bench.variants(args))     # not given: the knob decides
    try:
        bench.freq_weights("256,-1")
    except SystemExit as exc:
        assert "-1" in str(exc)
    else:
        raise AssertionError("a negative weight was accepted")


def test_prefetch_budgets_add_a_prefetch_row_per_variant_and_budget():
    import argparse
    bench = _bench_hybrid()
    args = argparse.Namespace(extra_fractions="", variants="=offload,=hybrid split", freq_weights="",
                              prefetch_budgets="2,4")
    rows = dict(bench.variants(args))
    assert set(rows) == {f"{n}{s}" for n in ("offload", "hybrid split") for s in ("", " prefetch2", " prefetch4")}
    assert rows["hybrid split prefetch4"] == {**rows["hybrid split"], "prefetch": 4}
    assert "prefetch" not in rows["offload"]
    args.prefetch_budgets = "auto"
    rows = dict(bench.variants(args))
    assert rows["offload prefetchauto"] == {**rows["offload"], "prefetch": "auto"}
