"""The flags several `ft` commands take, each declared here once: one type, one default, one help wherever it
appears (the engine's own flags are proto/engine_spec.py's `add_engine_flags`, the FREETOKEN_* knobs proto/knobs.py's
`add_cli_flag`). tests/test_cli_flags.py checks that a flag two commands declare is declared alike, bar the ones it
lists as meaning different things in different commands.

No torch here: `ft --help` and `ft serve` in process mode import it.
"""
from __future__ import annotations

import argparse
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEVICES = ("auto", "cpu", "cuda")
WORKER_MODES = ("process", "inline")


def fraction_flag(raw: str) -> float:
    """argparse type of a share in [0, 1] (--fetch-fraction): refused at parse time, naming the flag."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1] (0: every miss to the CPU, 1: fetch every miss), "
                                         f"got {raw!r}")
    return value


def add_log_level_flag(parser: Any) -> None:
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="this process's log level")


def add_parent_pid_flag(parser: Any) -> None:
    """The worker processes' (ft worker gpu / cpu / store), which their parent starts."""
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit at once if this is not the parent (closes the die-with-parent race)")


def add_device_flag(parser: Any) -> None:
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where the model runs, or what `ft bench bw` copies to (one GPU: pick it with "
                             "CUDA_VISIBLE_DEVICES)")


def add_fetch_fraction_flag(parser: Any) -> None:
    parser.add_argument("--fetch-fraction", type=fraction_flag, default=None, metavar="F",
                        help="cpu / hybrid: the share of the misses fetched over PCIe, in [0, 1] (default: from the "
                             "`ft bench bw` profile of this GPU and expert format, else 0.5; `ft serve` then tunes "
                             "it online, unless --no-auto-tune)")


def add_cpu_threads_flag(parser: Any) -> None:
    parser.add_argument("--cpu-threads", type=int, default=0,
                        help="compute threads per CPU expert worker (0: one per physical core)")


def add_reserve_cpus_flag(parser: Any) -> None:
    parser.add_argument("--reserve-cpus", default=None, metavar="LIST",
                        help="cpu / hybrid: CPUs the CPU workers keep off and the engine's process pins itself to "
                             "(--pin-gpu-worker; default: 0 on machines with >= 4 CPUs)")


def add_workers_flag(parser: Any) -> None:
    parser.add_argument("--workers", default="process", choices=WORKER_MODES,
                        help="process (default): the engine runs in a supervised `ft worker gpu` child, restarted "
                             "when it dies; inline: in a thread of this process (no isolation, no restarts)")
