"""`ft bench train-moe`: train a MoE language model from scratch and write a Hugging Face checkpoint
(workload/train_moe.py; docs/WORKLOAD.md). Importable without torch, as every `ft` subcommand module is."""
from __future__ import annotations

import argparse

from ftexpert.workload.train_args import add_arguments, check  # the dispatcher calls train_cli.add_arguments


def run(args: argparse.Namespace) -> int:
    # lazy: both import torch, which `ft --help` must not
    from ftexpert.workload.shapes import SHAPES
    from ftexpert.workload.train_moe import train

    check(args)
    train(SHAPES[args.shape], args.out, args.tokens, args.minutes, args.device, args.seed, args.corpus,
          curve_points=args.curve_points, compile=not args.no_compile)
    return 0
