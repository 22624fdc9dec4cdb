"""Where the 4-bit MoE decode GEMV's time goes, on the GPU machine: the kernels' K loops as its Triton compiled them,
and (under Nsight Compute) their hardware counters. docs/QUANTIZATION.md says why: fewer instructions in the K loop
did not make these kernels faster, so the instruction count alone does not say what bounds them.

    python bench/profile_quant_gemv.py --shape next|gptoss [--sass] [--calls N]
    ncu --clock-control none -k regex:quant_kernel --launch-skip 8 --launch-count 4 --csv --page details \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --metrics METRICS --log-file OUT.csv python bench/profile_quant_gemv.py --shape next --calls 12
    python bench/profile_quant_gemv.py --summarize-ncu OUT.csv

--sass: the SASS loops (bench/sass_loops.py) of the cubins this run compiled (a fresh TRITON_CACHE_DIR, so only
these kernels); --calls: eager calls of moe_gemv_quant with the format's default blocks (the profiler takes some).
--metrics-list prints the raw metrics the suite passes to ncu (warp stalls per issued instruction, issue activity).
`bash bench/run_gpu.sh quant_profile` runs all of it for both shapes.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = {   # name: (format, experts, hidden, intermediate, top-k)
    "next": ("nvfp4", 512, 2048, 512, 10),       # qwen3-next-80b-a3b
    "gptoss": ("mxfp4", 128, 2880, 2880, 4),     # gpt-oss-120b
}
STALLS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "math_pipe_throttle", "mio_throttle",
          "lg_throttle", "not_selected", "selected", "no_instruction", "dispatch_stall", "membar", "branch_resolving",
          "drain", "sleeping", "tex_throttle", "imc_miss", "misc")
METRICS = ([f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
           + ["smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
              "sm__warps_active.avg.pct_of_peak_sustained_active", "dram__bytes_read.sum"])
SUMMARY = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Registers Per Thread",
           "Achieved Occupancy", "Theoretical Occupancy", "Block Limit Registers", "Grid Size", "Waves Per SM",
           "Warp Cycles Per Issued Instruction", "Issued Warp Per Scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="next")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--sass", action="store_true", help="print the K loops of the kernels this run compiled")
    p.add_argument("--summarize-ncu", metavar="CSV", help="summarize an ncu --csv --page details log; runs nothing")
    p.add_argument("--metrics-list", action="store_true", help="print the raw metrics for ncu --metrics; runs nothing")
    return p.parse_args(argv)


def run_calls(args) -> None:
    import torch

    from ftexpert.kernels.expert_reference import quantize_expert
    from ftexpert.kernels.moe_decode.quant import moe_gemv_quant
    from ftexpert.proto.expert_format import ExpertFormat, QuantLayout
    fmt, E, H, I, K = SHAPES[args.shape]
    layout = QuantLayout(H, I, ExpertFormat.parse(fmt))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.empty(E, layout.expert_nbytes, dtype=torch.uint8, device="cuda")
    for e in range(E):                         # distinct bytes in every slot: no expert is read from L2 twice
        gate, up, down = (torch.empty(r, c, device="cuda").normal_(0, 0.02, generator=gen)
                          for r, c in ((I, H), (I, H), (H, I)))
        quantize_expert(gate, up, down, layout.fmt, out=rows[e])
    cpu_gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, H, device="cuda").to(torch.bfloat16)
    weights = torch.softmax(torch.randn(args.tokens, K, device="cuda"), -1)
    for _ in range(args.calls):                # other experts each call, as layers in turn would
        ids = torch.stack([torch.randperm(E, generator=cpu_gen)[:K] for _ in range(args.tokens)]).cuda()
        moe_gemv_quant(x, ids, weights, rows, layout)
    torch.cuda.synchronize()
    print(f"{args.shape}: {fmt} E={E} H={H} I={I} K={K} T={args.tokens}, {args.calls} calls of moe_gemv_quant, "
          f"{layout.expert_nbytes * K / 1e6:.2f} MB of experts a call")


def print_sass(cache_dir: str) -> None:
    from sass_loops import describe, loops, sass_of   # bench/ (this folder is sys.path[0])
    cubins = sorted(glob.glob(os.path.join(cache_dir, "**", "*quant_kernel*.cubin"), recursive=True))
    if not cubins:
        print(f"no quant kernel cubins under {cache_dir}")
    for path in cubins:
        for loop in loops(sass_of(path)):
            print(describe(loop))


def summarize_ncu(path: str) -> int:
    """One block per profiled kernel launch: the SUMMARY metrics and the raw ones the suite asked for (the warp
    stalls sorted, largest first)."""
    with open(path, newline="", errors="replace") as fh:
        lines = [line for line in fh if line.startswith('"')]
    if not lines:
        print(f"{path}: no CSV rows (did ncu profile anything? its messages are in the run's log)")
        return 1
    launches: dict[tuple[str, str], dict[str, str]] = {}
    for row in csv.DictReader(lines):
        key = (row.get("ID", ""), row.get("Kernel Name", ""))
        name, unit = row.get("Metric Name", ""), row.get("Metric Unit", "")
        launches.setdefault(key, {})[name] = f"{row.get('Metric Value', '')} {unit}".strip()
    for (lid, kernel), metrics in launches.items():
        print(f"== launch {lid}: {kernel[:90]}")
        for want in SUMMARY:
            if want in metrics:
                print(f"   {want:<36} {metrics[want]}")
        stalls = []
        for s in STALLS:
            v = metrics.get(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio", "")
            try:
                stalls.append((float(v.split()[0].replace(",", "")), s))
            except (ValueError, IndexError):
                continue
        if stalls:
            print("   stalls per issued instruction: "
                  + ", ".join(f"{s} {v:.2f}" for v, s in sorted(stalls, reverse=True) if v >= 0.05))
        for m in METRICS[len(STALLS):]:
            if m in metrics:
                print(f"   {m:<52} {metrics[m]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.metrics_list:
        print(",".join(METRICS))
        return 0
    if args.summarize_ncu:
        return summarize_ncu(args.summarize_ncu)
    if args.sass:                               # before Triton reads it: a cache of this run's kernels only
        cache = tempfile.mkdtemp(prefix="ft-triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = cache
    run_calls(args)
    if args.sass:
        print_sass(cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
