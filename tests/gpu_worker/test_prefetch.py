"""The lookahead expert prefetch (gpu_worker/backends/offload/prefetch.py) is lossless: prefetch on against off over 200
greedy decode steps of the embedded trained model, identical tokens and identical logits (every forward's, bit for
bit), eager, batch 1 and 2 (requests joining between decode steps: prefill chunks in between), global and
per-layer pools, the model's own router as predictor and a garbage one (random candidates). The counters show the
prefetch did something (installed, useful) and what `measure` counts without changing anything."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.backends.offload.prefetch import PrefetchSettings, RouterPredictor, attach_prefetch

from tests.gpu_worker.prefetch_util import assert_identical, decode_run, offload_model, open_windows

DECODE_STEPS = 200


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


_loaded = offload_model


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Prefetch off, per (pool layout, batch): computed once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        out = {}
        for per_layer in (False, True):
            for batch in (1, 2):
                model = _loaded(per_layer, None)
                out[per_layer, batch] = decode_run(model, batch=batch, decode_steps=DECODE_STEPS), \
                    model.experts.counters()
                model.close()
        return out


@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per-layer"])
@pytest.mark.parametrize("batch, predictor", [(1, "router"), (2, "router"), (2, "random")])
def test_prefetch_on_gives_the_same_tokens_and_logits_as_off(references, per_layer, batch, predictor):
    model = _loaded(per_layer, PrefetchSettings(mode="on", budget=4), predictor)
    try:
        run = decode_run(model, batch=batch, decode_steps=DECODE_STEPS)
        counters = model.experts.counters()
    finally:
        model.close()
    (ref_run, ref_counters) = references[per_layer, batch]
    assert_identical(ref_run, run, f"offload {'per-layer' if per_layer else 'global'} batch {batch} {predictor}")
    assert counters["prefetch_installed_total"] > 0, "the prefetch installed nothing: the test proves nothing"
    assert counters["prefetch_layer_calls_total"] >= DECODE_STEPS * (model.experts.num_layers - 1)
    if predictor == "router":
        assert counters["prefetch_useful_total"] > 0
        if not per_layer:
            # the trained router predicts: fewer demand misses than without the prefetch. (Per-layer pools of 4
            # slots hold nearly every expert this text routes, and a budget of 4 replaces a whole pool per layer:
            # more misses there, the same output.)
            assert counters["expert_misses_total"] < ref_counters["expert_misses_total"]


def run_mode(settings: PrefetchSettings, *, per_layer: bool = False, batch: int = 1, windows: bool = False):
    """A decode run of the embedded model with the prefetch `settings` (`windows`: an idle window given to auto's
    rule first, open_windows): the run, the backend's counters and what auto's rule decided (Lookahead.report)."""
    model = _loaded(per_layer, settings)
    try:
        if windows:
            open_windows(model.experts)
        run = decode_run(model, batch=batch, decode_steps=DECODE_STEPS)
        return run, model.experts.counters(), model.experts.lookahead.report()
    finally:
        model.close()


def test_measure_counts_without_changing_the_cache(references):
    """measure: the same tokens and logits, the same demand misses as off (nothing installed), useful > 0; with a
    window measured it also scores what auto would have chosen."""
    run, counters, report = run_mode(PrefetchSettings(mode="measure", budget=4), windows=True)
    ref_run, ref_counters = references[False, 1]
    assert_identical(ref_run, run, "measure")
    assert counters["prefetch_installed_total"] == 0
    assert counters["expert_misses_total"] == ref_counters["expert_misses_total"]
    assert counters["experts_fetched_total"] == ref_counters["experts_fetched_total"]
    assert 0 < counters["prefetch_useful_total"] <= counters["prefetch_predicted_total"]
    assert 0 < counters["prefetch_auto_useful_total"] <= counters["prefetch_auto_predicted_total"]
    assert report["gain_s_per_step"] > 0 and any(report["allowed"])


@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per-layer"])
@pytest.mark.parametrize("batch", [1, 2])
def test_auto_gives_the_same_tokens_and_logits_as_off(references, per_layer, batch):
    """auto with an idle window measured: it predicts, measures each rank's precision, installs what clears the
    break-even (the per-layer counts on the device), and the output is off's bit for bit."""
    run, counters, _ = run_mode(PrefetchSettings(mode="auto"), per_layer=per_layer, batch=batch, windows=True)
    ref_run, _ = references[per_layer, batch]
    assert_identical(ref_run, run, f"auto {'per-layer' if per_layer else 'global'} batch {batch}")
    # installs happen only where the rule's per-layer count on the device is > 0: the rule allowed some during the
    # run (its last counts, report["allowed"], follow the text's last steps and may be all 0 by the end)
    assert counters["prefetch_installed_total"] > 0, "the rule allowed nothing: the test proves nothing"
    assert counters["prefetch_installed_total"] <= counters["prefetch_auto_predicted_total"]
    assert 0 < counters["prefetch_auto_useful_total"] <= counters["prefetch_auto_predicted_total"]


def test_auto_without_measurements_does_nothing(references):
    """A cold start (on a CPU: always, no window is measured): auto runs no predictor and installs nothing."""
    run, counters, _ = run_mode(PrefetchSettings(mode="auto"))
    ref_run, ref_counters = references[False, 1]
    assert_identical(ref_run, run, "auto, cold")
    assert counters["prefetch_predicted_total"] == counters["prefetch_installed_total"] == 0
    assert counters["expert_misses_total"] == ref_counters["expert_misses_total"]


def test_settings_refuse_what_they_do_not_understand():
    with pytest.raises(ValueError, match="prefetch mode 'maybe'"):
        PrefetchSettings(mode="maybe")
    with pytest.raises(ValueError, match="budget"):
        PrefetchSettings(mode="on", budget=0)
    with pytest.raises(ValueError, match="k must be"):
        PrefetchSettings(mode="on", k=129)
    with pytest.raises(ValueError, match="verify"):
        PrefetchSettings(verify="bytes")


def test_resident_refuses_a_prefetch_and_accepts_off_and_auto():
    loaded = load_model(device="cpu")
    attach_prefetch(loaded.model, PrefetchSettings(mode="off"))
    attach_prefetch(loaded.model, PrefetchSettings(mode="auto"))      # auto: nothing without a slot cache
    with pytest.raises(ValueError, match="needs a slot cache"):
        attach_prefetch(loaded.model, PrefetchSettings(mode="on"))


def test_set_policy_switches_the_mode_live_and_keys_the_graphs():
    model = _loaded(False, PrefetchSettings(mode="off", budget=4))
    try:
        backend = model.experts
        key_off = backend.graph_key()
        backend.set_policy(prefetch="on", prefetch_budget=2)
        assert backend.lookahead.settings.mode == "on" and backend.lookahead.settings.budget == 2
        assert backend.graph_key() != key_off
        with pytest.raises(ValueError, match="prefetch mode"):
            backend.set_policy(prefetch="sometimes")
        assert backend.lookahead.settings.mode == "on", "a refused change changes nothing"
    finally:
        model.close()


def test_the_predictor_is_the_next_layers_router_on_this_layers_input():
    """RouterPredictor(L, h) ranks the experts as layer L's router would on h (one token: its top-k order)."""
    loaded = load_model(device="cpu")
    routers = [layer.router for layer in loaded.model.dense.layers]
    pred = RouterPredictor(routers, 6)
    h = torch.randn(1, routers[0].shape[1], generator=torch.Generator().manual_seed(0)).to(routers[0].dtype)
    want = torch.topk(torch.nn.functional.linear(h, routers[2]).float()[0], 6).indices
    assert torch.equal(pred.predict(2, h), want)
    assert not torch.equal(pred.predict(1, h), want), "another layer's router ranks differently"


def test_the_predictor_adds_a_routers_bias():
    """gpt-oss routes on biased logits: the predictor ranks by them (a large bias on one expert puts it first)."""
    gen = torch.Generator().manual_seed(1)
    routers = [torch.randn(8, 16, generator=gen) for _ in range(2)]
    bias = torch.zeros(8)
    bias[5] = 100.0
    h = torch.randn(3, 16, generator=gen)
    biased = RouterPredictor(routers, 4, [None, bias]).predict(1, h)
    assert int(biased[0]) == 5
    assert torch.equal(biased, torch.topk(torch.softmax(h @ routers[1].T + bias, -1).sum(0), 4).indices)
    assert torch.equal(RouterPredictor(routers, 4, [None, bias]).predict(0, h), RouterPredictor(routers, 4).predict(0, h))
