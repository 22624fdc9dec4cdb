"""`ft worker cpu`: run one CPU expert worker (started by the coordinator's CpuWorkerSet, or by systemd).

Nothing heavy is imported at module level: the process checklist runs before torch is loaded.
"""
from __future__ import annotations

import argparse

from ftexpert.proto.cli_flags import add_log_level_flag, add_parent_pid_flag
from ftexpert.proto.cpus import parse_cpulist
from ftexpert.proto.process_setup import setup_process

DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, help="name of the expert store segment in /dev/shm")
    parser.add_argument("--channel", default=None,
                        help="name of this worker's channel segment (default: <store>.cpu<worker-index>)")
    parser.add_argument("--worker-index", type=int, default=0, help="which worker of the pool this is")
    parser.add_argument("--num-workers", type=int, default=1, help="workers in the pool (placement splits cores)")
    parser.add_argument("--kernel", default="auto",
                        help="auto | torch | native | native-avx512_bf16 | native-avx512 | native-avx2 | native-scalar")
    parser.add_argument("--act-quant", default="auto", choices=("auto", "fp32", "int8"),
                        help="activations of 4-bit experts (int4, mxfp4, nvfp4): int8 in blocks of 16 with integer "
                             "dot products (AVX-512 VNNI; faster, docs/QUANTIZATION.md states the error), fp32, or "
                             "auto: int8 where the CPU has AVX-512 VNNI")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0 = one per physical core)")
    parser.add_argument("--reserve-cpus", default="", help="CPU list left to other processes, e.g. 0-1")
    parser.add_argument("--allowed-cpus", default=None, metavar="LIST",
                        help="CPUs to place this worker on, before --reserve-cpus (default: the affinity it "
                             "inherited); the worker sets its affinity to its share of them, wider than the "
                             "inherited one if need be. Its parent passes its own affinity from before it pinned "
                             "itself to the reserved CPUs, so a restarted worker is placed as the first was")
    parser.add_argument("--mempolicy", default="preferred", choices=("preferred", "bind", "none"))
    parser.add_argument("--no-pin", action="store_true", help="do not pin compute threads one per core")
    parser.add_argument("--spin-us", type=float, default=50.0, help="idle: spin this long between sleeps")
    parser.add_argument("--hot-ms", type=float, default=50.0, help="spin continuously this long after a request")
    parser.add_argument("--sleep-max-us", type=float, default=1000.0, help="longest idle sleep")
    parser.add_argument("--expect-config-hash", default=None, help="refuse a store with another config hash")
    parser.add_argument("--handshake-timeout-s", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT_S)
    add_parent_pid_flag(parser)
    parser.add_argument("--sysfs-root", default="/sys/devices/system", help=argparse.SUPPRESS)
    parser.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    add_log_level_flag(parser)


def run(args: argparse.Namespace) -> int:
    setup_process(f"cpu_worker[{args.worker_index}]", expected_parent_pid=args.parent_pid,
                  log_level=args.log_level)
    # lazy: torch (both import it) only after the checklist, and never for `ft --help`
    from ftexpert.cpu_expert_pool.worker import WorkerOptions, WorkerSettings, run_cpu_worker
    from ftexpert.proto.shm_layout import channel_name_for

    settings = WorkerSettings(kernel=args.kernel, act_quant=args.act_quant, num_threads=args.threads,
                              spin_us=args.spin_us, hot_ms=args.hot_ms,
                              sleep_max_us=args.sleep_max_us)
    options = WorkerOptions(
        store_name=args.store, channel_name=args.channel or channel_name_for(args.store, args.worker_index),
        worker_index=args.worker_index, num_workers=args.num_workers, settings=settings,
        reserved_cpus=parse_cpulist(args.reserve_cpus),
        allowed_cpus=None if args.allowed_cpus is None else parse_cpulist(args.allowed_cpus),
        mempolicy=args.mempolicy, pin_threads=not args.no_pin,
        expect_config_hash=args.expect_config_hash, handshake_timeout_s=args.handshake_timeout_s,
        sysfs_root=args.sysfs_root, warmup=not args.no_warmup)
    return run_cpu_worker(options)
