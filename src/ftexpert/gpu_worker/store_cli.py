"""`ft worker store`: open the model for a coordinator, report its facts, fill the expert store it created, exit.

`ft serve` (process mode, and `--attach`) starts it itself, once, before the GPU worker: the coordinator imports
neither torch nor the model-loading code, so this short-lived child reads the checkpoint for it. It talks over
the socket pair it inherits (--link-fd; proto/model_facts.py): the engine spec in, the model's facts out, then,
for the offload / cpu / hybrid strategies, the name of the store the coordinator created, which it fills.
Not meant to be run by hand. Nothing heavy is imported at module level: the process checklist runs first.
"""
from __future__ import annotations

import argparse

from ftexpert.proto.cli_flags import add_log_level_flag, add_parent_pid_flag
from ftexpert.proto.process_setup import setup_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-fd", type=int, required=True,
                        help="the inherited socket of the coordinator's model-facts link (proto/model_facts.py)")
    add_parent_pid_flag(parser)
    add_log_level_flag(parser)


def run(args: argparse.Namespace) -> int:
    setup_process("store", expected_parent_pid=args.parent_pid, log_level=args.log_level)
    # lazy: torch and the model-loading code from here on (after the checklist; never for `ft --help`)
    from ftexpert.gpu_worker.store_main import run_store_child

    return run_store_child(args.link_fd)

