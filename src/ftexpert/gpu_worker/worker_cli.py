"""`ft worker gpu`: run the GPU worker (the model, the KV cache, the engine loop) as its own process.

    ft worker gpu --engine-addr ipc:///run/ft/engine.sock

`ft serve` starts it itself (and restarts it); run it by hand, or from systemd
(deploy/ft-gpu-worker@.service), next to `ft serve --attach`. It has no engine flags: the coordinator's WELCOME
carries the whole engine spec (model, strategy, cache size, knobs: proto/engine_spec.py), resolved from the
coordinator's flags and FREETOKEN_* variables. The worker proves the coordinator's per-run key (`engine.key`
beside the ipc socket, or --engine-key-file).
Nothing heavy is imported at module level: the process checklist runs before torch is loaded.
"""
from __future__ import annotations

import argparse
import os
import sys

from ftexpert.proto.cli_flags import add_log_level_flag, add_parent_pid_flag
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
    add_parent_pid_flag(link)
    add_log_level_flag(parser)


def run(args: argparse.Namespace) -> int:
    setup_process(f"gpu_worker[{args.name}]", expected_parent_pid=args.parent_pid, log_level=args.log_level)
    # lazy: torch is imported from here on (after the checklist; never for `ft --help`)
    from ftexpert.gpu_worker.worker_main import GpuWorkerOptions, run_gpu_worker

    return run_gpu_worker(GpuWorkerOptions(engine_addr=args.engine_addr, name=args.name, store_name=args.store_name,
                                           key_file=args.engine_key_file, handshake_timeout_s=args.handshake_timeout_s,
                                           drain_timeout_s=args.drain_timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ft worker gpu", description="run the GPU worker")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
