"""`HybridOptions`: the settings of the `hybrid` and `cpu` expert backends, validated in one place.

Every field is also a flag of `ft generate` (coordinator/generate_cli.py); the fetch rounding and pinning
the GPU-driving process (--pin-gpu-worker) are FREETOKEN_* knobs (proto/knobs.py). Where the fetch fraction starts, in order: the given value
(--fetch-fraction), the `ft bench bw` profile measured on this GPU (or "cpu") for this expert format,
0.5. The profile is read by proto/bandwidth_profile.py's `load_bandwidth_profile`, which ignores a profile
of other hardware or another expert format with a log line. The CPU workers' own settings (count,
threads, placement) belong to their owner (coordinator/expert_resources.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from ftexpert.kernels.slot_cache.state import ROUND_MODES
from ftexpert.proto.shm_layout import DEFAULT_CPU_MAX_TOKENS
from ftexpert.proto.cpus import default_reserved_cpus, format_cpulist, parse_cpulist, set_process_affinity
from ftexpert.proto.bandwidth_profile import ExpertFormat, default_benchbw_path, load_bandwidth_profile
from ftexpert.proto.knobs import KNOBS_BY_FIELD, resolve

log = logging.getLogger("ft.hybrid")

DEFAULT_FETCH_FRACTION = 0.5          # no flag, no matching profile: half the misses each way
DEFAULT_CPU_DEADLINE_S = 1.0          # a CPU share not answered by then is fetched instead (worker killed)
DEFAULT_READY_TIMEOUT_S = 120.0       # how long attaching waits for each CPU worker to serve its channel
DEFAULT_READMIT_POLL_S = 0.02         # how often a forward looks for restarted workers


# This process's affinity from before pin_driving_process narrowed it (None: not pinned). The defaults that
# read the affinity (the reserved CPU, the workers' allowed set) read this instead, so a call made after the
# pin (a second pool, worker flags built later) sees the machine, not the one reserved core.
_affinity_before_pin: tuple[int, ...] | None = None


def unpinned_affinity() -> set[int]:
    """This process's CPU affinity, or what it was before the process pinned itself to the reserved CPUs."""
    return set(_affinity_before_pin) if _affinity_before_pin is not None else set(os.sched_getaffinity(0))


def unpin_driving_process() -> None:
    """Undo pin_driving_process (CpuPool.close): every thread back on the affinity from before the pin."""
    global _affinity_before_pin
    if _affinity_before_pin is not None:
        set_process_affinity(_affinity_before_pin)
        _affinity_before_pin = None


@dataclasses.dataclass
class HybridOptions:
    fetch_fraction: float | None = None     # f in [0, 1]; None: profile, else DEFAULT_FETCH_FRACTION
    fetch_round: str = KNOBS_BY_FIELD["fetch_round"].default     # rounding of f*M (ROUND_MODES)
    promote: bool = True                    # recency promotion (docs/slot_cache.md)
    seed: int = 0                           # stochastic rounding's seed
    cpu_deadline_s: float = DEFAULT_CPU_DEADLINE_S
    cpu_max_tokens: int = DEFAULT_CPU_MAX_TOKENS
    reserve_cpus: str | None = None         # CPU list the CPU workers keep off; None: "0" on >= 4 CPUs
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    readmit_poll_s: float = DEFAULT_READMIT_POLL_S
    engine_threads: int | None = None       # torch threads of this process; None: the reserved CPUs' count, >= 1
    benchbw_path: str = ""                  # `ft bench bw` profile; "": $FREETOKEN_BENCHBW_PATH or default
    pin_gpu_worker: bool | None = None      # pin the GPU-driving process to the reserved CPUs; None: the knob

    def __post_init__(self) -> None:
        if self.fetch_fraction is not None and not 0.0 <= float(self.fetch_fraction) <= 1.0:
            raise ValueError(f"--fetch-fraction {self.fetch_fraction} must be within [0, 1] "
                             f"(0: every miss to the CPU, 1: fetch every miss)")
        if self.fetch_round not in ROUND_MODES:
            raise ValueError(f"--fetch-round {self.fetch_round!r} is not one of {', '.join(ROUND_MODES)}")
        for name in ("cpu_deadline_s", "ready_timeout_s", "readmit_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.cpu_max_tokens < 1:
            raise ValueError(f"--cpu-max-tokens {self.cpu_max_tokens} must be >= 1")

    def for_strategy(self, strategy: str) -> "HybridOptions":
        """`cpu` = hybrid with f = 0 and promotion off: every miss to the CPU (docs/HYBRID.md)."""
        if strategy == "cpu":
            return dataclasses.replace(self, fetch_fraction=0.0, promote=False)
        if strategy != "hybrid":
            raise ValueError(f"HybridOptions serve the cpu and hybrid strategies, not {strategy!r}")
        return self

    def reserved_cpus(self) -> str:
        if self.reserve_cpus is not None:
            return self.reserve_cpus
        return default_reserved_cpus(unpinned_affinity())

    def pins_gpu_worker(self) -> bool:
        if self.pin_gpu_worker is not None:
            return self.pin_gpu_worker
        return resolve()["pin_gpu_worker"] == "on"

    def driving_process_cpus(self) -> tuple[int, ...]:
        """Where the process that drives the GPU pins itself: the reserved CPUs within its affinity; ()
        for nowhere (pinning off, nothing reserved, or no reserved CPU in its affinity)."""
        if not self.pins_gpu_worker():
            return ()
        return tuple(sorted(set(parse_cpulist(self.reserved_cpus())) & os.sched_getaffinity(0)))

    def pin_driving_process(self, what: str) -> tuple[int, ...] | None:
        """Pin the process that drives the GPU (and hosts the backend) to driving_process_cpus(), so the
        CPU workers, which keep off the reserved CPUs, have their cores to themselves. Returns the
        affinity before, or None where nothing was pinned; unpin_driving_process() restores it.

        Every thread, not only the calling one (sched_setaffinity(0) sets one thread): the others
        (engine-link IO, heartbeats, the doorbell watchdog, the supervisor's monitor, torch's pool, CUDA's
        helper threads) would otherwise run on the workers' cores and preempt their busy loops; they
        mostly sleep, so they do not crowd the reserved core. Threads started later inherit the mask.
        The cost, CPU workers this process (re)starts inheriting the narrow mask (`ft generate`), is met by
        their --allowed-cpus, resolved before the pin (coordinator/expert_resources.py)."""
        cpus = self.driving_process_cpus()
        if not cpus:
            reserved = self.reserved_cpus()
            if reserved and self.pins_gpu_worker():
                log.info("%s not pinned: none of the reserved CPUs %s is in its affinity %s", what, reserved,
                         format_cpulist(os.sched_getaffinity(0)))
            return None
        before = tuple(sorted(os.sched_getaffinity(0)))
        threads = set_process_affinity(cpus)
        global _affinity_before_pin
        if _affinity_before_pin is None:
            _affinity_before_pin = before
        log.info("pinned %s (pid %d, %d threads) to CPU %s, the reserved CPUs (was %s); the CPU workers keep "
                 "off them", what, os.getpid(), threads, format_cpulist(cpus), format_cpulist(before))
        return before

    def engine_thread_count(self) -> int:
        """Torch CPU threads for the process that hosts the backend. Its idle OpenMP threads spin on the
        cores the workers compute on: with 2 threads on the 2-core CI VM, tiny-model hybrid decode ran
        at 16-27 tok/s, with 1 thread at 430-490 tok/s (bench/bench_hybrid.py --preset tiny --device cpu)."""
        if self.engine_threads is not None:
            return max(1, self.engine_threads)
        reserved = self.reserved_cpus()
        return max(1, len(parse_cpulist(reserved))) if reserved else 1


def device_name(device: torch.device) -> str:
    """The name a bandwidth profile is keyed on: the CUDA device's name, or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def resolve_fetch_fraction(options: HybridOptions, *, dtype: torch.dtype, hidden_size: int,
                           intermediate_size: int, device: torch.device, fmt: str = "bf16") -> tuple[float, str]:
    """(f, where it came from): the given fraction, a `ft bench bw` profile entry of this GPU and expert format
    (`fmt`: the store's, an expert format label), or 0.5."""
    if options.fetch_fraction is not None:
        return float(options.fetch_fraction), "flag"
    path = resolve({"benchbw_path": options.benchbw_path or None})["benchbw_path"] or default_benchbw_path()
    profile = load_bandwidth_profile(path, ExpertFormat(str(dtype).removeprefix("torch."), hidden_size,
                                                        intermediate_size, fmt), device_name(device))
    if profile is None:
        log.info("fetch fraction %.2f (default): no matching bandwidth profile", DEFAULT_FETCH_FRACTION)
        return DEFAULT_FETCH_FRACTION, "default"
    log.info("fetch fraction %.3f from %s (PCIe %.1f GB/s, CPU %.1f GB/s)", profile.fetch_fraction, path,
             profile.pcie_gb_s, profile.cpu_gb_s)
    return profile.fetch_fraction, f"profile:{path}"
