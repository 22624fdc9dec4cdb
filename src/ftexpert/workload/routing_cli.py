"""`ft bench routing`: routing statistics of a trained checkpoint on held-out text, and the routing trace
(workload/routing.py; docs/WORKLOAD.md). Importable without torch, as every `ft` subcommand module is."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to route (default 16384)")
    p.add_argument("--trace", type=Path, help="also write the routing trace here")
    p.add_argument("--json", type=Path, help="also write the statistics as JSON here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))


def run(args: argparse.Namespace) -> int:
    from ftexpert.workload.routing import report

    if args.tokens < 2:
        raise ValueError("--tokens must be at least 2")
    report(args.model, args.tokens, trace_path=args.trace, json_path=args.json, device=args.device)
    return 0
