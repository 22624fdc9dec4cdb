"""CPU expert kernel bandwidth against this machine's DRAM read bandwidth (same run).

Shape: qwen3-30b-a3b experts (H=2048, I=768, bf16, 9.44 MB each). Each call computes one layer's
CPU share: `batch` tokens all routed to the same 8 experts (top-8), the 8-expert window moving
through a 128-expert store every call so weights come from DRAM, not cache. GB/s = weight bytes read
per call / median call time. Needs only torch, numpy, psutil, msgpack (and gcc for the compiled path).

    python bench/bench_cpu_experts.py                     # all cores of this process's affinity
    python bench/bench_cpu_experts.py --threads 16 --isas  # also every compiled ISA separately
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cpu_expert_pool.expert_kernel import ExpertKernel  # noqa: E402
from cpu_expert_pool.topology import discover_placements  # noqa: E402
from cpu_expert_pool.native.build import ISA_NAMES, try_load_native  # noqa: E402
from proto.expert_store import ExpertStore  # noqa: E402

GB = 1e9
QWEN3_30B_A3B = {"hidden": 2048, "intermediate": 768}
TOP_K = 8
SMALL_STORE_BYTES = 256e6          # below this, the store may fit a large last-level cache


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
    base = (torch.randn(store.shape.expert_numel, generator=g) / store.shape.hidden ** 0.5).to(torch.bfloat16)
    view = store.layer_view(0)                                                  # [E, expert_numel]
    for e in range(store.num_experts):
        view[e].copy_(base.roll(e))


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
    parser.add_argument("--isas", action="store_true", help="also time every compiled ISA this CPU has")
    parser.add_argument("--no-pin", action="store_true", help="do not pin compute threads to cores")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    top_k = args.experts_per_call
    if not 0 < top_k <= args.experts:
        parser.error(f"--experts-per-call must be in [1, --experts={args.experts}]")
    if args.threads is None:
        args.threads = sum(p.num_threads for p in discover_placements())

    name = f"ft-bench-experts-{os.getpid()}"
    store = ExpertStore.create(name, num_layers=1, num_experts=args.experts, dtype=torch.bfloat16,
                               config_hash="bench", **QWEN3_30B_A3B)
    try:
        fill_store(store)
        print(f"store: {args.experts} experts x {store.expert_bytes / 1e6:.2f} MB = {store.nbytes / GB:.2f} GB, "
              f"{top_k} experts a call, threads {args.threads}, torch {torch.__version__}")
        if store.nbytes < SMALL_STORE_BYTES:
            print("note: a store this small may stay in the last-level cache: the GB/s below are then "
                  "compute rates, not DRAM reads")
        dram = dram_read_gbps(store, args.threads, repeats=10)
        for what, gbps in dram.items():
            print(f"DRAM read bandwidth ({what}): {gbps:.1f} GB/s")
        dram_gbps = max(dram.values())

        native, why = try_load_native()
        kernels = ["torch"]
        if native is None:
            print(f"compiled kernel unavailable: {why}")
        else:
            kernels.append("native")
            if args.isas:
                kernels += [f"native-{ISA_NAMES[i]}" for i in range(native.best_isa - 1, -1, -1)]
        # One compute thread per physical core (SMT siblings left idle), as the worker pins them.
        cpus = list(discover_placements()[0].compute_cpus)[:args.threads]
        rows = []
        for kernel_name in kernels:
            kernel = ExpertKernel(store, kernel=kernel_name, num_threads=args.threads)
            if not args.no_pin and len(cpus) == args.threads:
                kernel.pin_threads(cpus)
            for batch in batches:
                hidden = torch.randn(batch, store.shape.hidden).to(torch.bfloat16)               # [T, H]
                token_idx = torch.arange(batch, dtype=torch.int32).repeat_interleave(top_k)     # [T*k]
                weight = torch.full((batch * top_k,), 1.0 / top_k)
                out = torch.empty(batch, store.shape.hidden)
                windows = args.experts // top_k
                state = {"call": 0}

                def one_call() -> None:
                    first = (state["call"] % windows) * top_k
                    state["call"] += 1
                    expert_id = torch.arange(first, first + top_k, dtype=torch.int32).repeat(batch)
                    kernel(0, hidden, token_idx, expert_id, weight, out)

                sec = median_s(one_call, args.repeats, args.warmup)
                gbps = top_k * store.expert_bytes / sec / GB
                rows.append((kernel.name, batch, sec * 1e6, sec * 1e6 / top_k, gbps, 100 * gbps / dram_gbps))
        print()
        print(f"{'kernel':<22} {'batch':>5} {'us/call':>9} {'us/expert':>10} {'GB/s':>7} {'% DRAM':>7}")
        for kernel_name, batch, us, us_expert, gbps, pct in rows:
            print(f"{kernel_name:<22} {batch:>5} {us:>9.0f} {us_expert:>10.1f} {gbps:>7.1f} {pct:>6.0f}%")
    finally:
        store.close()
        store.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
