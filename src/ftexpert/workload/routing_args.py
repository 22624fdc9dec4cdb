"""The command line of the routing statistics (workload/routing.py), shared by `ft bench routing`
(routing_cli.py) and ``python -m ftexpert.workload.routing``. Imports no torch."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to route (default 16384)")
    p.add_argument("--trace", type=Path, help="also write the routing trace here")
    p.add_argument("--json", type=Path, help="also write the statistics as JSON here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
