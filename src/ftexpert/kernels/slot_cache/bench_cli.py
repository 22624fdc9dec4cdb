"""`ft bench kernels`: the slot-cache kernel benchmark (needs a CUDA GPU)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="store_true",
                        help="time every decode-kernel setting, not only the defaults")
    parser.add_argument("--reps", type=int, default=200, help="graph replays timed per case")


def run(args: argparse.Namespace) -> int:
    from ftexpert.kernels.slot_cache.bench import main  # lazy: the benchmark's CUDA / triton stack, not for `ft --help`
    return main((["--sweep"] if args.sweep else []) + ["--reps", str(args.reps)])
