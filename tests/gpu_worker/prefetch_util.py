"""Shared by the prefetch tests: a greedy decode run that records every forward's logits, with requests arriving
between decode steps (so prefill chunks run between them)."""
from __future__ import annotations

import pytest
import torch

from dataclasses import dataclass
from typing import Any

from ftexpert.gpu_worker.api import BuiltEngine
from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.assembly.loader import open_model_source
from ftexpert.gpu_worker.backends.offload import OffloadExperts
from ftexpert.gpu_worker.backends.offload.prefetch import PrefetchSettings, RandomPredictor, model_predictor
from tests.built_engines import build, engine_of

# The embedded model: 4 layers x 8 experts, top-2. A global pool of 8 slots (a quarter), or per-layer pools of 4
# (half a layer); prefill chunks of 2 tokens (4 routes) fit either.
SLOTS = {False: 8, True: 4}


@dataclass
class Offloaded:
    """The embedded model's engine, built by build_engine, and the offload backend the test's engines run over: the
    built one, or per-layer pools of fewer slots than a layer has experts (which a spec refuses: one prefill call
    can route every expert of a layer; these tests' 2-token chunks route 4), made here over the built one's store."""
    built: BuiltEngine
    experts: Any

    def close(self) -> None:
        if self.experts is not self.built.experts:
            self.experts.close()
        self.built.close()


def offload_model(per_layer: bool, settings: PrefetchSettings | None, predictor: str = "router", seed: int = 3,
                  device: str = "cpu") -> Offloaded:
    """The embedded model over an offload backend of SLOTS[per_layer] slots (per layer: a pool of that many for
    every layer), with the prefetch `settings` (the spec's moe_prefetch fields; None: off) and the `predictor`:
    router (the model's own) or random (garbage, through build_engine's predictor hook)."""
    settings = settings or PrefetchSettings(mode="off")
    pred = None
    if predictor == "random":
        pred = RandomPredictor(open_model_source().cfg.num_experts, settings.k, seed=seed, device=device)
    prefetch = dict(moe_prefetch=settings.mode, moe_prefetch_budget=settings.budget, moe_prefetch_k=settings.k,
                    moe_prefetch_verify=settings.verify)
    with pytest.MonkeyPatch.context() as mp:
        # the counters by torch ops rather than the count kernel in the interpreter (slow; the GPU runs it)
        mp.delenv("TRITON_INTERPRET", raising=False)
        built = build(device=device, moe_strategy="offload", moe_cache_size=SLOTS[False], predictor=pred,
                      max_running_requests=2, max_context_tokens=512, **({} if per_layer else prefetch))
        if not per_layer:
            return Offloaded(built, built.experts)
        experts = OffloadExperts(built.experts.host, SLOTS[True], device, per_layer=True, owns_host=False)
    experts.set_prefetch(settings, pred if pred is not None else model_predictor(built.model, settings.k))
    return Offloaded(built, experts)


PROMPT_A = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8]
PROMPT_B = [300, 11, 64, 7, 250, 3, 99]
PROMPT_C = [41, 2, 77, 5, 190]


class LogitRecorder:
    """Keeps a copy of the logits of every forward the engine uses (prefill and decode): model.forward's eager ones,
    and each CUDA-graph replay's (DecodeGraphs.run). The forwards of a graph's warm-ups and capture are not the
    engine's (their logits are discarded, and a capture cannot copy to the host), so they are not recorded."""

    def __init__(self, model):
        from ftexpert.gpu_worker.engine.cuda_graphs import DecodeGraphs
        self.model, self.logits, self._capturing = model, [], False
        self._forward = model.forward
        model.forward = self
        self._graphs, self._run, self._capture = DecodeGraphs, DecodeGraphs.run, DecodeGraphs._capture
        recorder = self

        def run(graphs, inputs):
            out = recorder._run(graphs, inputs)
            recorder.logits.append(out.detach().to("cpu", copy=True))
            return out

        def capture(graphs, inputs):
            recorder._capturing = True
            try:
                return recorder._capture(graphs, inputs)
            finally:
                recorder._capturing = False

        DecodeGraphs.run, DecodeGraphs._capture = run, capture

    def __call__(self, *args, **kwargs):
        out = self._forward(*args, **kwargs)
        if not self._capturing:
            self.logits.append(out.detach().to("cpu", copy=True))
        return out

    def close(self) -> None:
        self.model.forward = self._forward
        self._graphs.run, self._graphs._capture = self._run, self._capture


def decode_run(run, *, batch: int, decode_steps: int, device: str = "cpu",
               cuda_graphs: bool = False) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and every forward's logits of an engine over `run` (an Offloaded, or a BuiltEngine) and its
    experts: request A alone; with batch 2, B joins after 20 decode steps and, once B is done, C joins (prefill
    chunks between decode steps). `decode_steps`: decode forwards in all."""
    engine = engine_of(getattr(run, "built", run), experts=run.experts, max_running_requests=max(batch, 1),
                       max_context_tokens=512, prefill_chunk_tokens=2, cuda_graphs="on" if cuda_graphs else "off")
    rec = LogitRecorder(engine.model)
    try:
        params_a = SamplingParams(max_new_tokens=decode_steps + 1, ignore_eos=True)
        tokens: dict = {}
        rid = engine.add_request(list(PROMPT_A), params_a)
        tokens[rid] = []
        steps = 0
        joined = []
        while engine.has_work():
            if batch > 1 and steps == 20 and not joined:
                joined.append(engine.add_request(list(PROMPT_B), SamplingParams(max_new_tokens=60, ignore_eos=True)))
                tokens[joined[-1]] = []
            if batch > 1 and steps == 110 and len(joined) == 1:
                joined.append(engine.add_request(list(PROMPT_C), SamplingParams(max_new_tokens=60, ignore_eos=True)))
                tokens[joined[-1]] = []
            for request_id, token_id, _finished, _reason, _ in engine.step():
                tokens[request_id].append(token_id)
            steps += 1
        return [tokens[k] for k in tokens], rec.logits
    finally:
        rec.close()


def assert_identical(a, b, what: str) -> None:
    tokens_a, logits_a = a
    tokens_b, logits_b = b
    assert tokens_a == tokens_b, f"{what}: tokens differ"
    assert len(logits_a) == len(logits_b), f"{what}: {len(logits_a)} forwards against {len(logits_b)}"
    for i, (x, y) in enumerate(zip(logits_a, logits_b)):
        assert torch.equal(x, y), f"{what}: forward {i}'s logits differ (max {float((x - y).abs().max()):.3g})"


def open_windows(backend, copies: float = 3.0) -> None:
    """Give the auto rule measurements a GPU's link probe would take (a CPU has no copy engine beside the compute,
    so it measures no idle window): every layer's window holds `copies` expert copies. The precision per rank is
    then measured on the CPU as on a GPU."""
    la = backend.slot_pool.lookahead
    for layer in range(backend.num_layers):
        la.rule.observe_window(layer, copies * 1e-3)
    la.rule.observe_bandwidth(la.expert_bytes, 1e-3)
    la.update_allowances()
    assert la.active
