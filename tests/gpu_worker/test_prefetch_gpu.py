"""The lookahead prefetch on the GPU (marked gpu: the H200 runs these): bit identity with prefetch off inside the
decode CUDA graphs and eagerly, batch 1 and 2, global and per-layer pools, the model's router and a garbage
predictor, with delay kernels on the predictor and copy streams (a copy or a prediction that is late must still be
waited for); and the negative control: without the compute stream's join the same delay changes the output. auto
(its link probe's events in the graphs, and installing with a window held) and measure the same."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.backends.offload.prefetch import Lookahead, PrefetchSettings

from tests.gpu_worker.prefetch_util import assert_identical, decode_run, offload_model, open_windows

pytestmark = pytest.mark.gpu
STEPS = 200
DELAY_CYCLES = 2_000_000          # ~1 ms at 1.98 GHz: far longer than a layer of the tiny model


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def delayed_streams(monkeypatch, join: bool = True) -> None:
    """A delay kernel before every prefetch copy (on the copy stream, ahead of its read of the plan) and every
    prediction (on the predictor stream); without `join`, the compute stream no longer waits for the prefetch copy
    (the fault the negative control injects: the next install rewrites the plan before the late copy reads it).
    The delays sit inside the work the lookahead forks and joins (the copy kernel, the predictor), so that a
    captured graph holds no side-stream node that nothing waits for (a capture with one fails)."""
    from ftexpert.gpu_worker.backends.offload import prefetch

    copy_plan = prefetch.copy_plan

    def slow_copy_plan(*args, **kwargs):
        if args[0].is_cuda:                           # the pool `slots`
            torch.cuda._sleep(DELAY_CYCLES)           # on the current stream: the copy stream
        return copy_plan(*args, **kwargs)

    monkeypatch.setattr(prefetch, "copy_plan", slow_copy_plan)
    for cls in (prefetch.RouterPredictor, prefetch.RandomPredictor):
        def slow_predict(self, layer, h, _predict=cls.predict):
            if h.is_cuda:
                torch.cuda._sleep(DELAY_CYCLES // 4)  # on the current stream: the predictor stream
            return _predict(self, layer, h)
        monkeypatch.setattr(cls, "predict", slow_predict)
    if not join:
        monkeypatch.setattr(Lookahead, "wait", lambda self, layer: None)


def _run(per_layer, settings, predictor, batch, graphs):
    model = offload_model(per_layer, settings, predictor, device="cuda")
    try:
        return decode_run(model, batch=batch, decode_steps=STEPS, cuda_graphs=graphs), model.experts.counters()
    finally:
        model.close()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per-layer"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("predictor", ["router", "random"])
def test_gpu_prefetch_on_is_bit_identical_with_delayed_streams(monkeypatch, graphs, per_layer, batch, predictor):
    ref, _ = _run(per_layer, None, "router", batch, graphs)
    delayed_streams(monkeypatch)
    run, counters = _run(per_layer, PrefetchSettings(mode="on", budget=2), predictor, batch, graphs)
    assert_identical(ref, run, f"graphs={graphs} per_layer={per_layer} batch={batch} {predictor}")
    assert counters["prefetch_installed_total"] > 0


def test_gpu_a_missing_join_changes_the_output(monkeypatch):
    """Negative control: the delayed prefetch copy without the compute stream's wait is read before it lands."""
    ref, _ = _run(False, None, "router", 1, True)
    delayed_streams(monkeypatch, join=False)
    run, counters = _run(False, PrefetchSettings(mode="on", budget=2), "router", 1, True)
    assert counters["prefetch_useful_total"] > 0
    with pytest.raises(AssertionError, match="differ"):
        assert_identical(ref, run, "missing join")


def _run_auto(per_layer, settings, batch, graphs, windows: bool):
    """`_run` for auto / measure; `windows`: a window given to the rule (open_windows) and kept there (the probe's
    own window samples dropped), so that auto installs whatever the tiny model's real windows are."""
    model = offload_model(per_layer, settings, "router", device="cuda")
    la = model.experts.lookahead
    try:
        if windows:
            open_windows(model.experts)
            la.rule.observe_window = lambda layer, seconds: None
            la.rule.observe_join = lambda layer, seconds: None
        run = decode_run(model, batch=batch, decode_steps=STEPS, cuda_graphs=graphs)
        return run, model.experts.counters(), la
    finally:
        model.close()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per-layer"])
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_prefetch_auto_is_bit_identical_and_its_probe_measures(monkeypatch, graphs, per_layer, batch):
    """auto in the decode graphs and eagerly: with the probe's real measurements (its events captured in the timed
    steps' graphs, read without a sync: windows, bandwidth and per-rank precision reach the rule), and with a window
    held open so that it installs, under delayed streams: the tokens and logits of off."""
    ref, _ = _run(per_layer, None, "router", batch, graphs)
    run, counters, la = _run_auto(per_layer, PrefetchSettings(mode="auto"), batch, graphs, windows=False)
    assert_identical(ref, run, f"auto, measured, graphs={graphs} per_layer={per_layer} batch={batch}")
    assert la.rule.bandwidth.samples > 0 and any(w.samples for w in la.rule.windows), "the probe measured nothing"
    delayed_streams(monkeypatch)
    run, counters, la = _run_auto(per_layer, PrefetchSettings(mode="auto"), batch, graphs, windows=True)
    assert_identical(ref, run, f"auto, window held, graphs={graphs} per_layer={per_layer} batch={batch}")
    assert counters["prefetch_installed_total"] > 0 and any(la.allowed)


def test_gpu_measure_scores_auto_in_the_graphs():
    ref, _ = _run(False, None, "router", 1, True)
    run, counters, la = _run_auto(False, PrefetchSettings(mode="measure", budget=2), 1, True, windows=True)
    assert_identical(ref, run, "measure")
    assert counters["prefetch_installed_total"] == 0
    assert 0 < counters["prefetch_auto_useful_total"] <= counters["prefetch_auto_predicted_total"]
