"""`ft bench kernels`: the slot-cache kernel benchmark (needs a CUDA GPU)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer variants and repetitions")
    parser.add_argument("--reps", type=int, default=200, help="graph replays timed per case")


def run(args: argparse.Namespace) -> int:
    from .bench import main
    return main((["--quick"] if args.quick else []) + ["--reps", str(args.reps)])
