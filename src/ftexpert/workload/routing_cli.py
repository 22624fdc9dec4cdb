"""`ft bench routing`: routing statistics of a trained checkpoint on held-out text, and the routing trace
(workload/routing.py; docs/WORKLOAD.md). Importable without torch, as every `ft` subcommand module is."""
from __future__ import annotations

import argparse

from ftexpert.workload.routing_args import add_arguments  # the dispatcher calls routing_cli.add_arguments


def run(args: argparse.Namespace) -> int:
    from ftexpert.workload.routing import report  # lazy: keeps torch out of `ft --help`

    if args.tokens < 2:
        raise ValueError("--tokens must be at least 2")
    report(args.model, args.tokens, trace_path=args.trace, json_path=args.json, device=args.device)
    return 0
