"""Where a call of the quantized CPU expert kernel spends its time: its phases, its barriers and the parts around.

The kernel's library built with -DFT_PHASE_TIMES (src/ftexpert/cpu_expert_pool/native/phase_times.h: each thread stamps
CLOCK_MONOTONIC at the end of each phase and past each barrier, the call at its entry and exit; the worker's library
has no stamps), called as the worker calls it, on bench_cpu_experts.py's stores (the qwen3-30b-a3b shape; each call
`experts a call` experts of a window that moves through the store, every token routed to all of them). Per row,
the median over calls, in us:

  call      the call, entry to exit
  enter     entry to the first thread in the parallel region (argument checks, the routing sort, the team's start)
  p0        phase 0, the slowest thread: out zeroed, x converted (and quantized, int8 path)
  p1 / p1-  phase 1 (gate / up), the slowest thread and the fastest
  hq        h quantized (int8 path), the slowest thread
  p2 / p2-  phase 2 (down), the slowest thread and the fastest
  bar       the three barriers: from the last thread's arrival to the last thread's leaving, summed
  exit      the last thread's end of phase 2 to the call's exit (the region's closing barrier, the unlock)

    python bench/bench_cpu_phases.py --format mxfp4,nvfp4 --batches 1,4 --experts-per-call 1,8
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_cpu_experts import filled_store  # noqa: E402
from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel  # noqa: E402
from ftexpert.cpu_expert_pool.native.act_desc import expert_act_desc  # noqa: E402
from ftexpert.cpu_expert_pool.native.build import HEADERS, ISA_BY_NAME, SOURCES, build_library  # noqa: E402
from ftexpert.cpu_expert_pool.native.quant_desc import QuantBindings, quant_format_desc  # noqa: E402
from ftexpert.cpu_expert_pool.topology import discover_placements  # noqa: E402
from ftexpert.proto.expert_format import ExpertFormat  # noqa: E402

COLUMNS = ("call", "enter", "p0", "p1", "p1-", "hq", "p2", "p2-", "bar", "exit")


def phases_of(call0: int, call1: int, m: np.ndarray) -> dict[str, float]:
    """One call's stamps (ns; m [threads, 8], phase_times.h's marks) -> the columns, in us."""
    us = 1e-3
    last = m.max(axis=0)
    return {"call": (call1 - call0) * us, "enter": (m[:, 0].min() - call0) * us,
            "p0": (m[:, 1] - m[:, 0]).max() * us, "p1": (m[:, 3] - m[:, 2]).max() * us,
            "p1-": (m[:, 3] - m[:, 2]).min() * us, "hq": (m[:, 5] - m[:, 4]).max() * us,
            "p2": (m[:, 7] - m[:, 6]).max() * us, "p2-": (m[:, 7] - m[:, 6]).min() * us,
            "bar": ((last[2] - last[1]) + (last[4] - last[3]) + (last[6] - last[5])) * us,
            "exit": (call1 - last[7]) * us}


def phase_library() -> QuantBindings:
    path = build_library(sources=SOURCES, headers=HEADERS, stem="libft_expert_ffn_phases",
                         extra_flags=("-DFT_PHASE_TIMES",))
    return QuantBindings(ctypes.CDLL(str(path)))


def bench(fmt: str, args, lib: QuantBindings, threads: int) -> list[tuple]:
    rows = []
    with filled_store(fmt, args.experts, "phases") as store:
        kernel = ExpertKernel(store, kernel="native", num_threads=threads, act_quant=args.act_quant)
        cpus = list(discover_placements()[0].compute_cpus)[:threads]
        if len(cpus) == threads:
            kernel.pin_threads(cpus)              # the process's OpenMP team, which the phase library's calls use
        isa = ISA_BY_NAME[kernel.name.removeprefix("native-")]     # the path the worker's kernel takes here
        desc = quant_format_desc(store.shape.quant_layout, act_int8=kernel.activations == "int8")
        act = expert_act_desc(store.shape)
        H = store.shape.hidden
        for k in (int(v) for v in args.experts_per_call.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                hidden = torch.randn(batch, H).to(torch.bfloat16)
                tok = torch.arange(batch, dtype=torch.int32).repeat_interleave(k)
                weight = torch.full((batch * k,), 1.0 / k)
                out = torch.empty(batch, H)
                windows = [torch.arange(f, f + k, dtype=torch.int32).repeat(batch)
                           for f in range(0, args.experts // k * k, k)]
                samples = []
                for call in range(args.warmup + args.repeats):
                    exp = windows[call % len(windows)]
                    lib.moe_layer(desc, isa, threads, store.data_ptr + store.expert_offset(0, 0), store.expert_stride,
                                  store.num_experts, H, store.shape.intermediate, hidden.data_ptr(), True, batch,
                                  tok.data_ptr(), exp.data_ptr(), weight.data_ptr(), tok.numel(), out.data_ptr(),
                                  act=act)
                    if call >= args.warmup:
                        samples.append(phases_of(*lib.phase_times()))
                med = {c: statistics.median(s[c] for s in samples) for c in COLUMNS}
                rows.append((f"{fmt} {kernel.name.removeprefix('native-')}", k, batch, med))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="mxfp4,nvfp4", help="quantized formats, comma-separated")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--experts-per-call", default="1,8", help="experts a call, comma-separated")
    parser.add_argument("--experts", type=int, default=64, help="experts in the store")
    parser.add_argument("--threads", type=int, default=None, help="default: one per physical core")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--act-quant", default="auto", choices=("auto", "fp32", "int8"))
    args = parser.parse_args()
    formats = [ExpertFormat.parse(f.strip()).label for f in args.format.split(",")]
    if any(not ExpertFormat.parse(f).quantized for f in formats):
        parser.error("--format: the quantized formats only (fp8, int4[-gN], mxfp4, nvfp4): bf16 runs expert_ffn.c")
    threads = args.threads or sum(p.num_threads for p in discover_placements())
    lib = phase_library()
    if lib.phase_times() is None:
        raise SystemExit("the phase build has no stamps (FT_PHASE_TIMES not compiled in)")
    rows = []
    for fmt in formats:
        rows += bench(fmt, args, lib, threads)
    print(f"threads {threads}, {args.repeats} calls a row after {args.warmup}; us, medians over calls")
    print(f"{'format, path':<18} {'experts':>7} {'batch':>5} " + " ".join(f"{c:>7}" for c in COLUMNS))
    for what, k, batch, med in rows:
        print(f"{what:<18} {k:>7} {batch:>5} " + " ".join(f"{med[c]:>7.1f}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
