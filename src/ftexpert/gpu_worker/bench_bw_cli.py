"""`ft bench bw`: measure PCIe and CPU-pool expert bandwidth; write the profile `--fetch-fraction` starts from.

    ft bench bw --preset qwen3-30b-a3b                  # bf16 2048x768 experts, this GPU (or "cpu")
    ft bench bw --model /models/Qwen3-30B-A3B --cpu-workers 2
    ft bench bw --preset tiny --device cpu --store-mib 8 --calls 50 --out /tmp/bw.json   # CI smoke
    ft bench bw --preset qwen3-30b-a3b --expert-format int4        # 4-bit experts: their own entry

The entry is keyed on the expert format (dtype, H, I, and the storage format: --expert-format, default bf16)
and the GPU name ("cpu" without CUDA); an
entry of the same key is replaced, others are kept. Where it goes: --out, else $FREETOKEN_BENCHBW_PATH
(--benchbw-path), else ~/.cache/freetoken/benchbw.json. The hybrid backend and `ft serve` start f at
pcie_gb_s / (pcie_gb_s + cpu_gb_s) of a matching entry and ignore the others (coordinator/policy.py).
With --shared (the default) the two also run at the same time, as the hybrid backend runs them:
pcie_shared_gb_s and cpu_shared_gb_s are what each side gets while the other runs (they share the host
DRAM), shared_gb_s the bytes both moved together a second; fetch_fraction still comes from the separate
figures (docs/POLICY.md says why).
Nothing heavy is imported at module level (`ft --help` stays fast).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ftexpert.proto.cli_flags import add_cpu_threads_flag, add_device_flag, add_reserve_cpus_flag
from ftexpert.proto.knobs import add_cli_flag, resolve

DEFAULT_STORE_MIB = 2048          # experts read per run: beyond any last-level cache
DEFAULT_CALLS = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fmt = parser.add_argument_group("expert format (default: the qwen3-30b-a3b preset)")
    fmt.add_argument("--preset", default=None, help="take H, I and dtype from a preset (tiny, qwen3-30b-a3b, ...)")
    fmt.add_argument("--model", default=None, metavar="DIR", help="take them from a checkpoint's config.json")
    fmt.add_argument("--dtype", default="auto", help="expert dtype (auto: the model's)")
    add_cli_flag(fmt, "expert_format")                   # the format measured
    add_device_flag(parser)
    parser.add_argument("--top-k", type=int, default=None, help="experts per CPU call (default: the model's top-k)")
    parser.add_argument("--cpu-workers", type=int, default=1, help="CPU worker processes, as `ft generate` starts")
    add_cpu_threads_flag(parser)
    add_reserve_cpus_flag(parser)
    parser.add_argument("--calls", type=int, default=DEFAULT_CALLS, help="timed copies and CPU calls")
    parser.add_argument("--store-mib", type=float, default=DEFAULT_STORE_MIB,
                        help="size of the temporary expert store the measurements read")
    parser.add_argument("--shared", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure both sides at once (the shared-DRAM ceiling of the hybrid roofline)")
    parser.add_argument("--out", default=None, metavar="PATH", help="profile to write (see above)")
    add_cli_flag(parser, "benchbw_path")                 # where, when --out is not given
    parser.add_argument("--json", action="store_true", help="print the written entry as JSON last")


def run(args: argparse.Namespace) -> int:
    # lazy: torch and the GPU worker's modules, which `ft --help` must not import
    import torch

    from ftexpert.proto.bandwidth_profile import default_benchbw_path
    from ftexpert.gpu_worker.backends.hybrid.bandwidth import (bench_store, copy_bandwidth, cpu_pool_bandwidth, shared_bandwidth,
                                             write_profile_entry)
    from ftexpert.cpu_expert_pool.api import worker_flags as cpu_worker_flags
    from ftexpert.gpu_worker.backends.hybrid.options import device_name
    from ftexpert.gpu_worker.assembly.device import resolve_device
    from ftexpert.gpu_worker.assembly.loader import open_model_source

    device = resolve_device(args.device)
    source = open_model_source(args.model, args.preset or (None if args.model else "qwen3-30b-a3b"),
                               dtype=args.dtype, device=device,
                               expert_format=resolve({"expert_format": args.expert_format})["expert_format"])
    cfg, dtype, fmt = source.cfg, source.dtype, source.expert_format.label
    top_k = args.top_k or cfg.top_k
    path = args.out or resolve({"benchbw_path": args.benchbw_path})["benchbw_path"] or default_benchbw_path()
    gpu_name = device_name(device)
    store = bench_store(cfg.hidden_size, cfg.expert_intermediate_size, dtype, int(args.store_mib * 2**20),
                        min_experts=4 * top_k * args.cpu_workers, fmt=fmt)
    try:
        t0 = time.perf_counter()
        copy = copy_bandwidth(store, device, args.calls)
        worker_flags = cpu_worker_flags(threads=args.cpu_threads, reserve_cpus=args.reserve_cpus,
                                        extra=("--log-level", "WARNING"))
        cpu = cpu_pool_bandwidth(store, top_k=top_k, calls=args.calls, num_workers=args.cpu_workers,
                                 worker_flags=worker_flags)
        shared = None
        if args.shared:
            try:
                shared = shared_bandwidth(store, device, top_k=top_k, calls=args.calls, num_workers=args.cpu_workers,
                                          worker_flags=worker_flags)
            except RuntimeError as exc:      # the separate figures still go to the profile
                print(f"ft bench bw: the shared probe failed, its keys are left out: {exc}", file=sys.stderr)
        elapsed_s = time.perf_counter() - t0
    finally:
        store.close()
        store.unlink()
    entry = {"gpu_name": gpu_name, "dtype": str(dtype).removeprefix("torch."), "format": fmt,
             "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.expert_intermediate_size, "pcie_gb_s": round(copy.gb_s, 3),
             "cpu_gb_s": round(cpu.gb_s, 3), "pcie_p10_gb_s": round(copy.p10_gb_s, 3),
             "cpu_p10_gb_s": round(cpu.p10_gb_s, 3),
             "copy_kind": "host->GPU DMA from the registered store" if device.type == "cuda" else "host memcpy (no CUDA)",
             "expert_bytes": store.expert_bytes, "top_k": top_k, "cpu_workers": args.cpu_workers,
             "cpu_threads": args.cpu_threads, "calls": args.calls,
             "fetch_fraction": round(copy.gb_s / (copy.gb_s + cpu.gb_s), 4),
             **(shared.fields() if shared else {}),
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}
    write_profile_entry(path, entry)
    together = f"; at the same time: {shared.summary()}" if shared else ""
    print(f"{gpu_name}, {fmt} experts ({entry['dtype']}) {cfg.hidden_size}x{cfg.expert_intermediate_size} "
          f"({store.expert_bytes / 1e6:.2f} MB): copy {copy.gb_s:.1f} GB/s (p10 {copy.p10_gb_s:.1f}), CPU pool "
          f"{cpu.gb_s:.1f} GB/s (p10 {cpu.p10_gb_s:.1f}; {args.cpu_workers} worker(s), top-{top_k} a call) -> "
          f"f = {entry['fetch_fraction']:.3f}{together}; {elapsed_s:.1f} s; written to {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(entry))
    return 0
