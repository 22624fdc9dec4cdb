"""The CPU expert pool's public interface, for the processes that start its workers.

``worker_argv`` is the one command line of a CPU worker (`ft worker cpu`); the coordinator's
``ExpertResources`` (coordinator/expert_resources.py) runs it under its supervisor, ``CpuWorkerProc``
runs it as a plain child (benchmarks, `ft bench bw`, tests). ``default_worker_count`` and
``place_store_for_workers`` are what the store's owner needs to know about placement: how many workers
the machine takes, and the NUMA binding of each expert's pages before the store is filled.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ftexpert.cpu_expert_pool.topology import discover_placements, place_store_for_workers
from ftexpert.proto.cpus import default_reserved_cpus, format_cpulist

__all__ = ["IMPORT_ROOT", "CpuWorkerProc", "default_worker_count", "place_store_for_workers", "reserved_cpus",
           "worker_argv", "worker_env", "worker_flags"]

IMPORT_ROOT = Path(__file__).resolve().parents[2]   # the folder that holds the ftexpert package (src/ or site-packages)
FT_COMMAND = (sys.executable, "-m", "ftexpert.coordinator.cli")      # the `ft` command (its dispatcher) in this interpreter


def worker_argv(*, store_name: str, channel_name: str, worker_index: int = 0, num_workers: int = 1,
                flags: Sequence[str] = ()) -> list[str]:
    """`ft worker cpu` for worker `worker_index` of `num_workers` serving `channel_name` over `store_name`;
    `flags`: its settings (--threads, --allowed-cpus, --reserve-cpus, --log-level, ...)."""
    return [*FT_COMMAND, "worker", "cpu", "--store", store_name, "--channel", channel_name, "--worker-index",
            str(worker_index), "--num-workers", str(num_workers), "--parent-pid", str(os.getpid()), *flags]


def reserved_cpus(reserve_cpus: str | None, affinity: Sequence[int] | set[int] | None = None) -> str:
    """The CPU list the workers keep off: `reserve_cpus` as given, or the default for `affinity`
    (this process's)."""
    if reserve_cpus is not None:
        return reserve_cpus
    return default_reserved_cpus(os.sched_getaffinity(0) if affinity is None else affinity)


def worker_flags(*, threads: int = 0, reserve_cpus: str | None = None, allowed_cpus: Sequence[int] | set[int] | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
    """A worker's placement flags: its compute threads (0: one per physical core), the CPUs to place it on
    (`--allowed-cpus`, default: this process's affinity now; a restart by a process that pinned itself
    since is placed as the first start was) and the reserved CPUs, then `extra`."""
    allowed = sorted(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    flags = ["--threads", str(threads), "--allowed-cpus", format_cpulist(allowed)]
    reserved = reserved_cpus(reserve_cpus, allowed)
    if reserved:
        flags += ["--reserve-cpus", reserved]
    return flags + list(extra)


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the folder that holds this package first on PYTHONPATH, so a child imports the same code."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(IMPORT_ROOT), env.get("PYTHONPATH", "")]))
    return env


def default_worker_count() -> int:
    """One CPU worker per NUMA node (or core group) of this process's affinity."""
    return len(discover_placements())


class CpuWorkerProc:
    """One `ft worker cpu` child process, not supervised (no restarts): benchmarks and tests."""

    def __init__(self, *, store_name: str, channel_name: str, worker_index: int = 0, num_workers: int = 1,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None):
        self.args = worker_argv(store_name=store_name, channel_name=channel_name, worker_index=worker_index,
                                num_workers=num_workers, flags=extra_args)
        self.log_path = log_path
        self.env = worker_env(env)
        self.popen: subprocess.Popen | None = None
        self._log_file = None

    def start(self) -> "CpuWorkerProc":
        self._log_file = open(self.log_path, "ab") if self.log_path else None
        self.popen = subprocess.Popen(self.args, cwd=IMPORT_ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                      stdout=self._log_file, stderr=subprocess.STDOUT if self._log_file else None)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, "start() first"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout_s: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after timeout_s. Returns the exit code."""
        if self.popen is None:
            return None
        if self.alive():
            self.signal(signal.SIGCONT)       # a stopped process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return self.popen.returncode
