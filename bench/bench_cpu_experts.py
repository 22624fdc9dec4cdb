"""CPU expert kernel bandwidth against this machine's DRAM read bandwidth (same run).

Shape: qwen3-30b-a3b experts (H=2048, I=768; bf16 9.44 MB each, fp8 4.7, int4-g128 2.5, mxfp4 2.5, nvfp4
2.7). Each call computes one layer's CPU share: `batch` tokens all routed to the same 8 experts (top-8), the
8-expert window moving through a 128-expert store every call so weights come from DRAM, not cache. GB/s =
the format's bytes read per call (codes and scales) / median call time; the DRAM read bandwidth is measured
in the same run, before each format's rows (a streaming read of that format's store). Needs only torch, numpy,
psutil, msgpack (and gcc for the compiled path).

    python bench/bench_cpu_experts.py                     # all cores of this process's affinity
    python bench/bench_cpu_experts.py --threads 16 --isas  # also every compiled ISA separately
    python bench/bench_cpu_experts.py --format all --batches 1,4   # bf16 and every quantized format side by side
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel  # noqa: E402
from ftexpert.cpu_expert_pool.topology import discover_placements  # noqa: E402
from ftexpert.cpu_expert_pool.native.build import ISA_NAMES, try_load_native  # noqa: E402
from ftexpert.kernels.expert_reference import quantize_expert  # noqa: E402
from ftexpert.proto.expert_format import ExpertFormat  # noqa: E402
from ftexpert.proto.expert_store import ExpertStore  # noqa: E402

GB = 1e9
QWEN3_30B_A3B = {"hidden": 2048, "intermediate": 768}
TOP_K = 8
SMALL_STORE_BYTES = 256e6          # below this, the store may fit a large last-level cache
ALL_FORMATS = ("bf16", "fp8", "int4-g128", "mxfp4", "nvfp4")
QUANT_TOP_ISA = 2                  # the quantized kernel's widest path (avx512)


def median_s(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dram_read_gbps(store: ExpertStore, threads: int, repeats: int) -> dict[str, float]:
    """(a) torch sum over 1 GiB fp32; (b) a streaming read of the store in place."""
    torch.set_num_threads(threads)
    big = torch.ones(256 * 1024 * 1024, dtype=torch.float32)                    # 1 GiB
    out = {"torch sum 1 GiB": big.numel() * 4 / median_s(big.sum, repeats, 2) / GB}
    del big
    native, _ = try_load_native()
    if native is not None:
        out["native read of the store"] = store.nbytes / median_s(
            lambda: native.read_bytes(store.data_ptr, store.nbytes, threads), repeats, 2) / GB
    return out


def fill_store(store: ExpertStore) -> None:
    g = torch.Generator().manual_seed(0)
    view = store.layer_view(0)                                                  # [E, expert_numel]
    if store.expert_format.quantized:          # one expert quantized, copied: the bytes' place is what is timed
        H, I = store.shape.hidden, store.shape.intermediate
        gate, up = (torch.randn(I, H, generator=g) / H ** 0.5 for _ in range(2))
        base = quantize_expert(gate, up, torch.randn(H, I, generator=g) / I ** 0.5, store.expert_format)
        for e in range(store.num_experts):
            view[e].copy_(base)
        return
    base = (torch.randn(store.shape.expert_numel, generator=g) / store.shape.hidden ** 0.5).to(torch.bfloat16)
    for e in range(store.num_experts):
        view[e].copy_(base.roll(e))


@contextlib.contextmanager
def filled_store(fmt: str, experts: int, tag: str):
    """A one-layer store of `experts` experts of the qwen3-30b-a3b shape in `fmt`, filled (fill_store), unlinked after."""
    store = ExpertStore.create(f"ft-bench-{tag}-{os.getpid()}-{fmt}", num_layers=1, num_experts=experts,
                               dtype=torch.bfloat16, config_hash="bench", fmt=fmt, **QWEN3_30B_A3B)
    try:
        fill_store(store)
        yield store
    finally:
        store.close()
        store.unlink()


def bench_format(fmt: str, args, batches: list[int], top_k: int, dram_rows: list) -> list[tuple]:
    """The rows of one format: its store, the DRAM read just before, then every kernel and batch."""
    rows = []
    with filled_store(fmt, args.experts, "experts") as store:
        print(f"{fmt} store: {args.experts} experts x {store.expert_bytes / 1e6:.2f} MB = {store.nbytes / GB:.2f} GB, "
              f"{top_k} experts a call, threads {args.threads}, torch {torch.__version__}")
        if store.nbytes < SMALL_STORE_BYTES:
            print("note: a store this small may stay in the last-level cache: the GB/s below are then "
                  "compute rates, not DRAM reads")
        dram = dram_read_gbps(store, args.threads, repeats=10)
        dram_rows += [(fmt, what, gbps) for what, gbps in dram.items()]
        dram_gbps = max(dram.values())

        native, why = try_load_native()
        quantized = store.expert_format.quantized
        kernels = [] if quantized else ["torch"]       # the torch path of quantized stores is not timed here
        if native is None:
            print(f"compiled kernel unavailable: {why}")
        else:
            kernels.append("native")
            if args.isas:
                top = min(native.best_isa, QUANT_TOP_ISA) if quantized else native.best_isa
                kernels += [f"native-{ISA_NAMES[i]}" for i in range(top - 1, -1, -1)]
        # One compute thread per physical core (SMT siblings left idle), as the worker pins them.
        cpus = list(discover_placements()[0].compute_cpus)[:args.threads]
        for kernel_name in kernels:
            kernel = ExpertKernel(store, kernel=kernel_name, num_threads=args.threads, act_quant=args.act_quant)
            label = kernel.name + ("+int8" if kernel.activations == "int8" else "")     # int8 activations
            if not args.no_pin and len(cpus) == args.threads:
                kernel.pin_threads(cpus)
            for batch in batches:
                hidden = torch.randn(batch, store.shape.hidden).to(torch.bfloat16)               # [T, H]
                token_idx = torch.arange(batch, dtype=torch.int32).repeat_interleave(top_k)     # [T*k]
                weight = torch.full((batch * top_k,), 1.0 / top_k)
                out = torch.empty(batch, store.shape.hidden)
                # Each call's experts made before the timing, as the worker finds them in shared memory: the
                # timed call is the kernel's (and ExpertKernel's argument checks), not the making of its input.
                windows = [torch.arange(first, first + top_k, dtype=torch.int32).repeat(batch)
                           for first in range(0, args.experts // top_k * top_k, top_k)]
                state = {"call": 0}

                def one_call() -> None:
                    expert_id = windows[state["call"] % len(windows)]
                    state["call"] += 1
                    kernel(0, hidden, token_idx, expert_id, weight, out)

                sec = median_s(one_call, args.repeats, args.warmup)
                gbps = top_k * store.expert_bytes / sec / GB
                rows.append((fmt, label, batch, store.expert_bytes / 1e6, sec * 1e6, sec * 1e6 / top_k, gbps,
                             100 * gbps / dram_gbps))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: one per physical core of this process's affinity)")
    parser.add_argument("--experts", type=int, default=128, help="experts in the store (one layer)")
    parser.add_argument("--batches", default="1,4,16", help="tokens per expert per call")
    parser.add_argument("--experts-per-call", type=int, default=TOP_K,
                        help="experts each call computes (top-k); every token uses all of them")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--act-quant", default="auto", choices=("auto", "fp32", "int8"),
                        help="activations of the 4-bit formats (ExpertKernel's act_quant; auto: int8 on AVX-512 VNNI)")
    parser.add_argument("--isas", action="store_true", help="also time every compiled ISA this CPU has")
    parser.add_argument("--no-pin", action="store_true", help="do not pin compute threads to cores")
    parser.add_argument("--format", default="bf16",
                        help="expert formats, comma-separated (bf16, fp8, int4[-g32|-g64|-g128], mxfp4, nvfp4), or "
                             f"all ({', '.join(ALL_FORMATS)})")
    args = parser.parse_args()
    formats = list(ALL_FORMATS) if args.format == "all" else [f.strip() for f in args.format.split(",")]
    formats = [ExpertFormat.parse(f).label for f in formats]                    # refuses unknown formats
    batches = [int(b) for b in args.batches.split(",")]
    top_k = args.experts_per_call
    if not 0 < top_k <= args.experts:
        parser.error(f"--experts-per-call must be in [1, --experts={args.experts}]")
    if args.threads is None:
        args.threads = sum(p.num_threads for p in discover_placements())

    rows, dram_rows = [], []
    for fmt in formats:
        rows += bench_format(fmt, args, batches, top_k, dram_rows)
    print()
    for fmt, what, gbps in dram_rows:
        print(f"DRAM read bandwidth before the {fmt} rows ({what}): {gbps:.1f} GB/s")
    print()
    print(f"{'format':<10} {'kernel':<20} {'batch':>5} {'MB/expert':>9} {'us/call':>9} {'us/expert':>10} {'GB/s':>7} "
          f"{'% DRAM':>7}")
    for fmt, kernel_name, batch, mb, us, us_expert, gbps, pct in rows:
        print(f"{fmt:<10} {kernel_name:<20} {batch:>5} {mb:>9.2f} {us:>9.0f} {us_expert:>10.1f} {gbps:>7.1f} "
              f"{pct:>6.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
