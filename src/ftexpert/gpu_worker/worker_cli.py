"""`ft worker gpu`: run the GPU worker (the model, the KV cache, the engine loop) as its own process.

    ft worker gpu --engine-addr ipc:///run/ft/engine.sock --model /models/Qwen3-30B-A3B --moe-strategy offload

`ft serve` starts it itself (and restarts it); run it by hand, or from systemd
(deploy/ft-gpu-worker@.service), next to `ft serve --attach`. The engine flags (--model, --preset,
--moe-strategy, --moe-cache-size, --max-running-requests, --max-context-tokens, --num-cpu-workers) must
equal the coordinator's: the HELLO carries their hash and a mismatch is refused, naming the fields. The
worker proves the coordinator's per-run key (`engine.key` beside the ipc socket, or --engine-key-file).
Nothing heavy is imported at module level: the process checklist runs before torch is loaded.
"""
from __future__ import annotations

import argparse
import os
import sys

from ftexpert.proto.knobs import add_cli_flag, positive_int_flag, resolve
from ftexpert.proto.link_auth import KEY_FILE_ENV, default_engine_addr
from ftexpert.proto.process_setup import setup_process

DEFAULT_PORT = 1919                     # `ft serve`'s default HTTP port: its default runtime directory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    link = parser.add_argument_group("engine link")
    link.add_argument("--engine-addr", default=os.environ.get("FT_ENGINE_ADDR") or default_engine_addr(DEFAULT_PORT),
                      help="ZMQ address of the coordinator's engine link, ipc://PATH or loopback TCP [env "
                           "FT_ENGINE_ADDR; default: the socket of `ft serve --attach` on port 1919]")
    link.add_argument("--engine-key-file", default=None, metavar="PATH",
                      help=f"the coordinator's per-run key (mode 0600, this user's) [env {KEY_FILE_ENV}; default: "
                           f"engine.key beside the ipc socket; needed for a TCP link]")
    link.add_argument("--name", default="gpu0", help="worker name in logs, HELLO and `ft ctl workers` (gpu<N>)")
    link.add_argument("--handshake-timeout-s", type=float, default=120.0,
                      help="how long to say HELLO before giving up (the coordinator may start later)")
    link.add_argument("--drain-timeout-s", type=float, default=30.0,
                      help="on SIGTERM: how long requests in flight may run on before they are aborted")
    link.add_argument("--store", default=None, dest="store_name",
                      help="expert store to attach (default: the name the coordinator's WELCOME gives)")
    link.add_argument("--parent-pid", type=int, default=None,
                      help="exit at once if this is not the parent (closes the die-with-parent race)")
    model = parser.add_argument_group("engine (must match the coordinator's)")
    model.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the tiny model)")
    model.add_argument("--preset", default=None, help="model preset (random weights of a real model's shape)")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="where the model runs (one GPU: pick it with CUDA_VISIBLE_DEVICES)")
    model.add_argument("--moe-strategy", default="resident", choices=("resident", "offload", "cpu", "hybrid"))
    model.add_argument("--moe-cache-size", type=int, default=None, help="GPU expert slots (offload/hybrid)")
    model.add_argument("--max-running-requests", type=int, default=8, help="requests decoding together")
    model.add_argument("--max-context-tokens", type=int, default=None, help="prompt + generated tokens per request")
    model.add_argument("--prefill-chunk-tokens", type=positive_int_flag, default=None,
                       help="prompt tokens a prefill chunk takes (default: 4096; cpu/hybrid: 512); local to this "
                            "process, not part of the coordinator's config")
    model.add_argument("--num-cpu-workers", type=int, default=0, help="CPU expert workers (cpu/hybrid strategies)")
    add_cli_flag(model, "expert_format")        # part of the coordinator's config (hashed)
    add_cli_flag(parser, "moe_slot_audit")      # local: a check, not part of the coordinator's config
    add_cli_flag(parser, "pdl")                 # local: the same tokens either way
    add_cli_flag(parser, "overlap_decode")      # local: the same tokens either way
    add_cli_flag(parser, "eviction_freq_weight")   # local: the same tokens either way
    add_cli_flag(parser, "eviction_freq_half_life")
    for field in ("moe_prefetch", "moe_prefetch_budget", "moe_prefetch_k", "moe_prefetch_verify"):
        add_cli_flag(parser, field)             # local: the lookahead prefetch is lossless (docs/PREFETCH.md)
    cpus = parser.add_argument_group("CPUs (cpu/hybrid; local to this process, not part of the coordinator's config)")
    cpus.add_argument("--reserve-cpus", default=None, metavar="LIST",
                      help="the CPUs the CPU workers keep off, where this process pins itself once loaded (`ft "
                           "serve` passes its own; default: 0 on machines with >= 4 CPUs)")
    add_cli_flag(cpus, "pin_gpu_worker")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def run(args: argparse.Namespace) -> int:
    setup_process(f"gpu_worker[{args.name}]", expected_parent_pid=args.parent_pid, log_level=args.log_level)
    # lazy: torch is imported from here on (after the checklist; never for `ft --help`)
    from ftexpert.gpu_worker.worker_main import GpuWorkerOptions, run_gpu_worker

    if args.max_running_requests < 1:
        raise ValueError("--max-running-requests must be >= 1")
    knobs = resolve({"pin_gpu_worker": args.pin_gpu_worker, "expert_format": args.expert_format,
                     "moe_slot_audit": args.moe_slot_audit, "pdl": args.pdl,
                     "eviction_freq_weight": args.eviction_freq_weight,
                     "eviction_freq_half_life": args.eviction_freq_half_life, "overlap_decode": args.overlap_decode,
                     **{f: getattr(args, f) for f in ("moe_prefetch", "moe_prefetch_budget", "moe_prefetch_k",
                                                      "moe_prefetch_verify")}})
    # lazy: torch / triton, like worker_main above
    from ftexpert.gpu_worker.backends.offload.prefetch import settings_from_knobs
    from ftexpert.kernels.pdl import apply_setting
    apply_setting(knobs["pdl"], args.device)
    options = GpuWorkerOptions(
        engine_addr=args.engine_addr, name=args.name, model=args.model, preset=args.preset, device=args.device,
        moe_strategy=args.moe_strategy, moe_cache_size=args.moe_cache_size, expert_format=knobs["expert_format"],
        max_running_requests=args.max_running_requests, max_context_tokens=args.max_context_tokens,
        num_cpu_workers=args.num_cpu_workers, store_name=args.store_name, key_file=args.engine_key_file,
        handshake_timeout_s=args.handshake_timeout_s, drain_timeout_s=args.drain_timeout_s,
        reserve_cpus=args.reserve_cpus,
        pin_gpu_worker=knobs["pin_gpu_worker"] == "on",
        overlap_decode=None if knobs["overlap_decode"] == "auto" else knobs["overlap_decode"] == "on",
        slot_audit_every=knobs["moe_slot_audit"], prefill_chunk_tokens=args.prefill_chunk_tokens,
        eviction_freq_weight=knobs["eviction_freq_weight"], eviction_freq_half_life=knobs["eviction_freq_half_life"],
        prefetch=settings_from_knobs(knobs))
    return run_gpu_worker(options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ft worker gpu", description="run the GPU worker")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
