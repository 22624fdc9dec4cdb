"""Shared by the kernel micro-benchmarks in this folder: time a function inside one CUDA graph."""
from __future__ import annotations

import argparse
import statistics

import torch


def add_graph_timing_args(p: argparse.ArgumentParser) -> None:
    """--calls / --reps / --warmup of `time_graph`, with the same defaults in every benchmark."""
    p.add_argument("--calls", type=int, default=48, help="calls captured in one graph (48 = layers)")
    p.add_argument("--reps", type=int, default=30, help="graph replays timed (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed graph replays first")


def time_graph(fn, calls: int, reps: int, warmup: int) -> float:
    """Median seconds per call of fn(i) for i in range(calls), captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):                       # compile / autotune / allocate outside the graph
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)
