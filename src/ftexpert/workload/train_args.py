"""The command line of MoE training (workload/train_moe.py), shared by `ft bench train-moe` (train_cli.py)
and ``python -m ftexpert.workload.train_moe``. Importable without torch."""
from __future__ import annotations

import argparse
from pathlib import Path

SHAPE_NAMES = ("default", "olmoe-routing", "qwen3-30b-a3b-routing", "tiny")     # workload/shapes.py (checked there)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, choices=SHAPE_NAMES)
    p.add_argument("--out", required=True, type=Path, help="new (or empty) checkpoint directory")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, help="training tokens (default: the shape's)")
    budget.add_argument("--minutes", type=float, help="wall-clock training budget")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve-points", type=int, default=0, help="record the routing statistics on held-out "
                   "text at this many points from step 0 to the end (ft_workload.json 'curve')")
    p.add_argument("--no-compile", action="store_true", help="CUDA: run the decoder layers eagerly "
                   "(default: torch.compile them)")
    p.add_argument("--corpus", default=None, help="UTF-8 text, one document per line (.xz ok); "
                   "default: the bundled King James Bible")


def check(args: argparse.Namespace) -> None:
    """Refuse what the parser cannot: a budget that is not positive, a CUDA device that is not there."""
    import torch  # lazy: keeps torch out of `ft --help` (the parser is built without it)

    if args.tokens is not None and args.tokens <= 0:
        raise ValueError("--tokens must be positive")
    if args.curve_points < 0:
        raise ValueError("--curve-points must be >= 0")
    if args.minutes is not None and args.minutes <= 0:
        raise ValueError("--minutes must be positive")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
