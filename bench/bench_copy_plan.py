"""The plan-copy kernel (kernels/expert_copy) against DMA copies of the same experts, host -> GPU.

Each figure: one CUDA graph of `--calls` back-to-back calls (the kernel with a plan of n copies, grid
sized for 8 as in a batch-1 decode step; or n `copy_` DMA copies), timed with events over `--reps`
replays, median per call. GB/s = n x expert bytes / time. The kernel reads mapped pinned host memory
with SM loads, so how many bytes are in flight (programs per expert, words per iteration, warps)
decides whether it keeps the PCIe link as busy as the copy engine does; a decode layer copies only a
few experts (3.6 a layer at a 25% cache of qwen3-30b-a3b), so n = 1..4 matters most.

Hot and cold sources (`--source hot,cold`): `hot` (the default) copies the same few host rows in every call
(they can stay in the host's last-level cache between calls, so it is the best case); `cold` gives every call
of the graph its own host rows from a pool of calls x max(n) experts (40 calls of 8: 3.0 GB), so each replay
streams that many distinct bytes from host DRAM, as a decode step's misses do from the 58 GB expert store.
docs/BENCHMARKS.md ("Offload decode at 10 / 25 / 50%") holds the cold figures.

    python bench/bench_copy_plan.py [--copies 1,2,4,8] [--chunks 64,128,256] [--blocks 2048,4096] [--warps 4,8]
        [--source hot,cold]
        [--split 384 --split-rows 16,32,64]   # the split slot's copy (kernels/expert_split) of the GPU's channels
                                 # [c, I) of one qwen3-30b-a3b expert, per limit c, per w2 rows a program:
                                 # GB/s of the bytes it moves, cold rows, beside the plan copy's n=1
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from graph_timing import time_graph  # noqa: E402  (bench/graph_timing.py: this folder is sys.path[0])
from ftexpert.kernels.expert_copy import copy_plan  # noqa: E402
from ftexpert.kernels.expert_split import api as split_api  # noqa: E402

QWEN3_EXPERT_BYTES = 3 * 2048 * 768 * 2        # gate, up, down of qwen3-30b-a3b in bf16: 9.44 MB
MAX_COPIES = 8                                   # batch 1, top-8: the engine's grid bound


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def bench_split(args, host: torch.Tensor, gb: float) -> None:
    """The split slot's copy (both parts, cold rows) per limit c and rows per program; checked once."""
    H, I = 2048, 768
    if args.expert_bytes != 3 * H * I * 2:
        print("--split: the qwen3-30b-a3b expert only (--expert-bytes default)")
        return
    rows = host.view(torch.bfloat16)                       # [pool_rows, N]
    slots = torch.zeros((2, rows.shape[1]), dtype=torch.bfloat16, device="cuda")
    calls = min(args.calls, rows.shape[0])
    for c in _ints(args.split):
        moved = 3 * (I - c) * H * 2 / 1e9
        descs = [torch.tensor([i, c], dtype=torch.int32, device="cuda") for i in range(calls)]
        for w2_rows in _ints(args.split_rows):
            split_api.W2_ROWS = w2_rows

            def split(i, descs=descs):
                for part in (0, 1):
                    split_api.split_copy(slots, rows, descs[i % calls], split_slot=1, hidden=H, intermediate=I,
                                         part=part)
            t = time_graph(split, calls, args.reps, args.warmup)
            print(f"split copy c={c} w2_rows={w2_rows}: {t * 1e6:.1f} us, {moved / t:.1f} GB/s "
                  f"(a whole expert by the plan kernel would take {gb / moved * t * 1e6:.0f} us at this rate)",
                  flush=True)
        slots.zero_()
        split(0)
        torch.cuda.synchronize()
        want = rows[0].clone().view(torch.int16)           # words: random bytes make NaNs, which equal nothing
        got = slots[1].cpu().view(torch.int16)
        gate = want[:I * H].view(I, H).clone()
        gate[:c] = 0
        assert torch.equal(got[:I * H].view(I, H), gate), f"split c={c}: wrong gate rows"
        assert torch.equal(got[2 * I * H:].view(H, I)[:, c:], want[2 * I * H:].view(H, I)[:, c:]), \
            f"split c={c}: wrong down columns"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--expert-bytes", type=int, default=QWEN3_EXPERT_BYTES)
    parser.add_argument("--copies", default="1,2,4,8")
    parser.add_argument("--chunks", default="64,128,256,512")
    parser.add_argument("--blocks", default="2048,4096")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--calls", type=int, default=10, help="calls per graph replay")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=1, help="untimed graph replays first")
    parser.add_argument("--source", default="hot", help="hot, cold or hot,cold (see above)")
    parser.add_argument("--split", default="", help="limits c (CPU channels [0, c)) of the split slot's copy to time")
    parser.add_argument("--split-rows", default="32", help="w2 rows per program of the split copy (W2_ROWS)")
    args = parser.parse_args()
    sources = [v.strip() for v in args.source.split(",") if v.strip()]
    if not sources or any(v not in ("hot", "cold") for v in sources):
        parser.error(f"--source {args.source!r}: use hot, cold or hot,cold")
    if not torch.cuda.is_available():
        print("bench_copy_plan: needs a CUDA GPU")
        return 2
    words = args.expert_bytes // 2
    copies = _ints(args.copies)
    gb = args.expert_bytes / 1e9
    pool_rows = max(2 * MAX_COPIES, args.calls * max(copies)) if "cold" in sources else 2 * MAX_COPIES
    host = torch.empty((pool_rows, words), dtype=torch.int16, pin_memory=True)
    host.view(torch.uint8)[: 2 * MAX_COPIES].random_(0, 256)
    slots = torch.zeros((2 * MAX_COPIES, words), dtype=torch.int16, device="cuda")
    evict = torch.arange(MAX_COPIES, dtype=torch.int32, device="cuda")
    results = []
    for source in sources:
        def rows_of(i: int, n: int, source=source) -> list[int]:
            """Host rows of call i: the same MAX_COPIES.. rows (hot), or call i's own n rows (cold)."""
            return list(range(MAX_COPIES, MAX_COPIES + n)) if source == "hot" else list(range(i * n, i * n + n))
        tag = "" if len(sources) == 1 else f" [{source}]"
        for n in copies:
            def dma(i, n=n, rows_of=rows_of):
                for j, r in enumerate(rows_of(i, n)):
                    slots[j].copy_(host[r], non_blocking=True)
            t = time_graph(dma, args.calls, args.reps, args.warmup)
            results.append((f"dma (copy engine){tag}", n, t))
            print(f"dma{tag} n={n}: {t * 1e6:.1f} us, {n * gb / t:.1f} GB/s", flush=True)
        for chunks, block, warps in itertools.product(_ints(args.chunks), _ints(args.blocks), _ints(args.warps)):
            label = f"kernel chunks={chunks} block={block} warps={warps}{tag}"
            for n in copies:
                num = torch.tensor([n], dtype=torch.int32, device="cuda")
                srcs = [torch.tensor(rows_of(i, n) + [0] * (MAX_COPIES - n), dtype=torch.int32, device="cuda")
                        for i in range(args.calls)]

                def kernel(i, num=num, srcs=srcs, chunks=chunks, block=block, warps=warps):
                    copy_plan(slots, host, evict, srcs[i], num, max_copies=MAX_COPIES, chunks=chunks,
                              block_words=block, num_warps=warps)
                t = time_graph(kernel, args.calls, args.reps, args.warmup)
                results.append((label, n, t))
            print(f"{label}: " + ", ".join(
                f"n={n} {n * gb / t:.1f} GB/s" for name, n, t in results[-len(copies):]), flush=True)
    src = torch.arange(MAX_COPIES, 2 * MAX_COPIES, dtype=torch.int32, device="cuda")
    slots.zero_()
    copy_plan(slots, host, evict, src, torch.tensor([MAX_COPIES], dtype=torch.int32, device="cuda"),
              max_copies=MAX_COPIES)
    torch.cuda.synchronize()
    assert torch.equal(slots[:MAX_COPIES].cpu(), host[MAX_COPIES:2 * MAX_COPIES]), "the kernel moved wrong bytes"

    if args.split:
        bench_split(args, host, gb)
    dma = {(name.partition("[")[2], n): t for name, n, t in results if name.startswith("dma")}
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; expert {args.expert_bytes / 1e6:.2f} MB; "
          f"a graph of {args.calls} calls, median of {args.reps} replays; GB/s (% of DMA at the same n)")
    print(f"{'copy':<53}" + "".join(f"{'n=' + str(n):>16}" for n in copies))
    names = list(dict.fromkeys(name for name, _, _ in results))
    for name in names:
        cells = []
        for n in copies:
            t = next(t for nm, k, t in results if nm == name and k == n)
            cells.append(f"{n * gb / t:>9.1f} ({100 * dma[(name.partition('[')[2], n)] / t:>3.0f}%)")
        print(f"{name:<53}" + "".join(f"{c:>16}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
