"""What the soak samples of a running `ft serve`: its process tree (memory, open files, threads, the worker
pids by role), its shared-memory segments in /dev/shm (count and bytes), and counters from /metrics."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

SHM_DIR = "/dev/shm"


@dataclass
class TreeSample:
    processes: int = 0
    rss_bytes: int = 0
    open_files: int = 0               # file descriptors of every process of the tree (sockets, pipes, maps)
    threads: int = 0
    shm_segments: int = 0             # the run's files in /dev/shm (the store and its CPU channels)
    shm_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def process_tree(pid: int) -> list:
    # lazy: psutil (the soak extra) loads only for a soak
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pids_of(pid: int, needle: str) -> list[int]:
    """Pids in the tree of `pid` whose command line holds `needle` ("worker gpu", "worker cpu")."""
    out = []
    for p in process_tree(pid)[1:]:
        try:
            if needle in " ".join(p.cmdline()):
                out.append(p.pid)
        except Exception:  # noqa: BLE001 - a process that just exited
            pass
    return out


def shm_segments(prefix: str) -> dict[str, int]:
    """name -> bytes of the /dev/shm files whose names start with `prefix`."""
    out = {}
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return out
    for name in names:
        if name.startswith(prefix):
            try:
                out[name] = os.stat(os.path.join(SHM_DIR, name)).st_size
            except OSError:
                pass
    return out


def sample_tree(pid: int, shm_prefix: str) -> TreeSample:
    s = TreeSample()
    for p in process_tree(pid):
        try:
            with p.oneshot():
                s.rss_bytes += p.memory_info().rss
                s.open_files += p.num_fds()
                s.threads += p.num_threads()
            s.processes += 1
        except Exception:  # noqa: BLE001 - a process that just exited
            pass
    segments = shm_segments(shm_prefix)
    s.shm_segments, s.shm_bytes = len(segments), sum(segments.values())
    return s


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> name -> value (labelled series of one name are summed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


_LABEL = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{name="([^"]*)"\}\s+([-+0-9.eEinfNa]+)')


def named_values(text: str, metric: str) -> dict[str, float]:
    """Prometheus text -> the series of `metric` labelled by `name` (ft_engine_counter_total, ft_engine_stat)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m and m.group(1) == metric:
            try:
                out[m.group(2)] = float(m.group(3))
            except ValueError:
                pass
    return out
