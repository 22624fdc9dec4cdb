"""The start-of-process checklist every worker process (`ft worker cpu`, `ft worker gpu`) runs before anything big.

Process title (setproctitle, when installed), die with the parent (PR_SET_PDEATHSIG), faulthandler,
a logger prefixed with the role. CPU/NUMA binding and the big allocations come after (worker.py).
"""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s [{role} pid %(process)d] %(name)s: %(message)s"


def set_process_title(title: str) -> bool:
    try:
        import setproctitle  # optional dependency
    except ImportError:
        return False
    setproctitle.setproctitle(title)
    return True


def die_with_parent(expected_parent_pid: int | None = None) -> bool:
    """SIGKILL this process when its parent exits. Exits now if the parent is already gone.

    Linux fires this when the parent *thread* that forked us exits: spawn workers from a long-lived
    thread (the main thread or a supervisor's monitor thread), never from a short-lived helper."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        ok = False
    if expected_parent_pid is not None and os.getppid() != expected_parent_pid:
        sys.stderr.write(f"parent process {expected_parent_pid} is gone; exiting\n")
        os._exit(1)
    return ok


def setup_process(role: str, *, expected_parent_pid: int | None = None, log_level: str = "INFO") -> logging.Logger:
    set_process_title(f"ft {role}")
    die_with_parent(expected_parent_pid)
    faulthandler.enable(all_threads=True)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format=LOG_FORMAT.format(role=role), stream=sys.stderr, force=True)
    return logging.getLogger(f"ft.{role}")
