"""CUDA graphs of the decode forward, captured per shape and replayed with each step's inputs.

A decode forward has fixed shapes for a key (T requests, attention bucket): `Engine.decode_forward` makes no
host sync when the expert backend makes none. The first step with a new key captures a graph (after two eager
warm-ups on a side stream, which write the same K/V values the replay writes); later steps copy their token ids,
positions and slots into the graph's static inputs and replay it. All graphs share one memory pool, and the KV
cache, its block tables and the weights are outside it, so every replay sees the live cache and the block tables
as the engine last wrote them (in place, between steps: `KVCache.sync`).

An expert backend says with `graph_safe(num_pairs)` whether a forward of that many (token, expert) pairs makes no
host sync and has fixed shapes (`ResidentExperts` in its gemv mode and, bf16 on Hopper+, its grouped one;
offload's decode copy kernel, hybrid's device hand-off), and with `graph_key()` what host state a captured forward
depends on; other steps run eagerly.
"""
from __future__ import annotations

import gc
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from ftexpert.gpu_worker.engine.decode_step import DecodeInputs
from ftexpert.gpu_worker.engine.state_cache import StateCache
from ftexpert.gpu_worker.models.model import MoeModel

MAX_GRAPHS = 64
WARMUP_RUNS = 2


class DecodeRunner(Protocol):
    """What the graphs capture: the `Engine`'s decode forward (called through the engine, so that a forward it
    replaces is the one captured), its model and its linear-layer states."""
    model: MoeModel
    states: StateCache | None

    def decode_forward(self, inputs: DecodeInputs) -> torch.Tensor: ...


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs        # static input tensors the graph reads
    logits: torch.Tensor        # [T, V] static output the graph writes


class DecodeGraphs:
    def __init__(self, engine: DecodeRunner, max_graphs: int = MAX_GRAPHS):
        self.engine, self.max_graphs = engine, max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0
        self.capture_s = 0.0        # host time inside captures (their warm-up forwards included), summed
        self.replays = 0
        self.replay_host_s = 0.0    # host time inside graph.replay() (cudaGraphLaunch), summed over replays

    def usable(self, num_requests: int) -> bool:
        return self.engine.model.experts.graph_safe(num_requests * self.engine.model.cfg.top_k)

    def _key(self, inputs: DecodeInputs) -> tuple:
        return (inputs.token_ids.numel(), inputs.bucket_tokens,
                self.engine.model.experts.graph_key())      # host state the forward reads

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits [T, V] of the decode forward for `inputs`, through a captured graph."""
        key = self._key(inputs)
        captured = self.graphs.get(key)
        if captured is None:
            t0 = time.perf_counter()
            captured = self._capture(inputs)
            self.capture_s += time.perf_counter() - t0
        else:
            self.graphs.move_to_end(key)
        static = captured.inputs
        static.token_ids.copy_(inputs.token_ids)
        static.positions.copy_(inputs.positions)
        static.slot_ids.copy_(inputs.slot_ids)
        t0 = time.perf_counter()
        captured.graph.replay()
        self.replay_host_s += time.perf_counter() - t0
        self.replays += 1
        return captured.logits

    def _capture(self, inputs: DecodeInputs) -> _Captured:
        static = DecodeInputs(inputs.token_ids.clone(), inputs.positions.clone(),
                              inputs.slot_ids.clone(), inputs.bucket_tokens)
        states = self.engine.states             # linear-layer states: the warm-ups must not advance them
        saved = states.snapshot(static.slot_ids) if states is not None else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                if saved is not None:
                    states.restore(static.slot_ids, saved)
                self.engine.decode_forward(static)
            if saved is not None:
                states.restore(static.slot_ids, saved)
        torch.cuda.current_stream().wait_stream(side)
        # After the warm-ups, which may have changed the backend's state (an eager failure); the capture itself
        # must not change it (HybridExperts does so only in step_begin / step_end, outside the forward).
        key = self._key(static)
        graph = torch.cuda.CUDAGraph()
        # No cyclic garbage collection while capturing: torch.cuda.graph does not collect first, and a dead engine
        # (Engine <-> DecodeGraphs is a cycle) collected mid-capture destroys its graphs, a CUDA call that a
        # capture does not permit, so the capture fails ("operation not permitted when stream is capturing
        # (function reset)", then cudaErrorStreamCaptureInvalidated; tests/gpu_worker/test_cuda_graphs_gpu.py
        # provokes that collection mid-capture)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.engine.decode_forward(static)
        finally:
            if collecting:
                gc.enable()
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        self.graphs[key] = _Captured(graph, static, logits)
        self.captures += 1
        return self.graphs[key]
