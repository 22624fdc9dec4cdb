"""The expert-miss policy: how many of the M misses of a layer are fetched over PCIe (f*M), and how
the CPU-assigned rest is split among CPU workers; re-tuned online from per-step telemetry.

The fetch side and the CPU side run in parallel, so a step's miss work ends when the slower side
ends. Fetching k of M misses costs about k / r_pcie seconds and computing the rest (M - k) / r_cpu
(r = experts a second; r_cpu sums the workers, each given a share proportional to its own rate).
Both end together at
    f* = k / M = r_pcie / (r_pcie + r_cpu) = B_pcie / (B_pcie + B_cpu)
(B = r * bytes per expert). The tuner keeps decayed sums of measured seconds and experts for each
side (a throughput EWMA that weighs a step by its work, not one noisy ratio per step), moves f a
damped step toward f* each telemetry step, and adds a small bounded integral term from the waits
(the GPU waiting on the CPU's partial outputs means the CPU side was slower: fetch more; waiting on
copies means the opposite), which corrects for costs the per-expert times miss (hand-off latency).
f always stays within [fetch_fraction_min, fetch_fraction_max], a sub-range of [0, 1].

Where f starts: a given fraction (`--fetch-fraction`), else the `ft bench bw` profile measured on
this GPU for this expert format, else 0.5. A profile from other hardware or another expert format
is ignored with a log line, never misapplied.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from ftexpert.proto.bandwidth_profile import BandwidthProfile, ExpertFormat, default_benchbw_path, load_bandwidth_profile
from ftexpert.proto.knobs import KNOBS_BY_FIELD

log = logging.getLogger("ft.coordinator.policy")

STRATEGIES = ("resident", "offload", "cpu", "hybrid")
FETCH_ROUNDS = KNOBS_BY_FIELD["fetch_round"].choices

Q16_ONE = 1 << 16
DEFAULT_FETCH_FRACTION = 0.5
# Defaults keep both sides sampled, so the tuner sees when either one changes speed; pure offload or
# pure CPU is a strategy, not a fraction.
DEFAULT_FRACTION_MIN = 0.05
DEFAULT_FRACTION_MAX = 0.95
DEFAULT_GAIN = 0.25              # share of the way to f* taken per telemetry step
DEFAULT_DECAY = 0.9              # weight of history in the throughput sums, per sampled step
DEFAULT_WAIT_GAIN = 0.02         # integral gain on the normalised wait imbalance
WAIT_BIAS_LIMIT = 0.25           # |bias from waits| never exceeds this
MIN_WAIT_SIGNAL_S = 20e-6        # waits below this (both sides together) carry no signal
DECISION_STEP = 1.0 / 512        # a change of f smaller than this is not pushed to the engine

def fraction_to_q16(fraction: float) -> int:
    """f as the Q16 fixed point the slot-cache kernel and its reference read (0..65536)."""
    if not math.isfinite(fraction):
        raise ValueError(f"fetch fraction must be a finite number, got {fraction!r}")
    return max(0, min(Q16_ONE, int(round(fraction * Q16_ONE))))


@dataclass(frozen=True)
class StepTelemetry:
    """What one decode step reports about its miss work (all layers together)."""
    experts_fetched: int = 0                          # experts copied host -> GPU
    copy_time_s: float = 0.0                          # copy-stream time spent on them
    cpu_experts: Mapping[str, int] = field(default_factory=dict)     # per CPU worker: experts computed
    cpu_time_s: Mapping[str, float] = field(default_factory=dict)    # per CPU worker: compute time
    gpu_wait_for_cpu_s: float = 0.0                   # GPU idle at the join, waiting for CPU outputs
    gpu_wait_for_copy_s: float = 0.0                  # GPU idle before expert GEMMs, waiting for copies


class _DecayedRate:
    """Experts a second from decayed sums of experts and seconds (sampled steps only)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.experts = 0.0
        self.seconds = 0.0

    def add(self, experts: float, seconds: float) -> bool:
        if not (experts > 0 and seconds > 0 and math.isfinite(experts) and math.isfinite(seconds)):
            return False
        self.experts = self.decay * self.experts + experts
        self.seconds = self.decay * self.seconds + seconds
        return True

    @property
    def per_s(self) -> float | None:
        return self.experts / self.seconds if self.seconds > 0 else None

    def seed(self, per_s: float, weight_experts: float = 1.0) -> None:
        self.experts, self.seconds = weight_experts, weight_experts / per_s


@dataclass
class PolicySettings:
    strategy: str = "hybrid"
    fetch_fraction: float = DEFAULT_FETCH_FRACTION
    fetch_fraction_min: float = DEFAULT_FRACTION_MIN
    fetch_fraction_max: float = DEFAULT_FRACTION_MAX
    auto_tune: bool = True
    fetch_round: str = KNOBS_BY_FIELD["fetch_round"].default      # split: on the device hand-off (docs/HYBRID.md)
    prefetch: str = ""          # the lookahead prefetch set live: auto | off | measure | on; "": as started
    prefetch_budget: int = 0    # its experts per layer, 1..128; 0: as the engine started

    def validate(self) -> None:
        def choice(name: str, value: str, choices: tuple[str, ...]) -> None:
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")
        choice("strategy", self.strategy, STRATEGIES)
        choice("fetch_round", self.fetch_round, FETCH_ROUNDS)
        choice("prefetch", self.prefetch, ("", *KNOBS_BY_FIELD["moe_prefetch"].choices))
        if isinstance(self.prefetch_budget, bool) or not isinstance(self.prefetch_budget, int) \
                or not 0 <= self.prefetch_budget <= 128:
            raise ValueError(f"prefetch_budget={self.prefetch_budget!r} is not valid: must be an int in [1, 128] "
                             f"(0: as the engine started)")
        for name in ("fetch_fraction", "fetch_fraction_min", "fetch_fraction_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):
                raise ValueError(f"{name}={value!r} is not valid: must be a number in [0, 1]")
        if self.fetch_fraction_min > self.fetch_fraction_max:
            raise ValueError(f"fetch_fraction_min={self.fetch_fraction_min} exceeds "
                             f"fetch_fraction_max={self.fetch_fraction_max}; swap them")
        if not self.auto_tune and not self.fetch_fraction_min <= self.fetch_fraction <= self.fetch_fraction_max:
            # a fixed fraction is used as given, never moved into the bounds behind the operator's back
            raise ValueError(f"fetch_fraction={self.fetch_fraction:g} is outside [fetch_fraction_min="
                             f"{self.fetch_fraction_min:g}, fetch_fraction_max={self.fetch_fraction_max:g}]; "
                             f"widen the bounds too (0 computes every miss on the CPU pool, 1 fetches all)")


class FetchPolicy:
    """Settings + online tuner. Thread-safe: the engine thread feeds telemetry, RPC threads read/set."""

    def __init__(self, settings: PolicySettings | None = None, *, expert_format: ExpertFormat | None = None,
                 profile: BandwidthProfile | None = None, source: str = "default",
                 gain: float = DEFAULT_GAIN, decay: float = DEFAULT_DECAY, wait_gain: float = DEFAULT_WAIT_GAIN):
        self._lock = threading.Lock()
        self.settings = settings or PolicySettings()
        self.settings.validate()
        if not (0 < gain <= 1 and 0 < decay < 1 and 0 <= wait_gain < 1):
            raise ValueError(f"tuner constants out of range: gain={gain} (0,1], decay={decay} (0,1), "
                             f"wait_gain={wait_gain} [0,1)")
        self.gain, self.decay, self.wait_gain = gain, decay, wait_gain
        self.expert_format = expert_format
        self._pcie = _DecayedRate(decay)
        self._cpu: dict[str, _DecayedRate] = {}
        self._wait_bias = 0.0
        self._fraction = self._clamp(self.settings.fetch_fraction)   # tuner's continuous value
        self._published = self._fraction                              # what the engine was told
        self.source = source
        self.reason = "initial value"
        self.decisions_total = 0
        self.telemetry_steps_total = 0
        if profile is not None:
            bpe = profile.expert_format.bytes_per_expert
            self._pcie.seed(profile.pcie_gb_s * 1e9 / bpe)
            self._cpu["profile"] = _DecayedRate(decay)
            self._cpu["profile"].seed(profile.cpu_gb_s * 1e9 / bpe)
            self._fraction = self._published = self._clamp(profile.fetch_fraction)
            self.source = f"profile:{profile.path}"
            self.reason = (f"profile: B_pcie {profile.pcie_gb_s:.1f} GB/s, B_cpu {profile.cpu_gb_s:.1f} GB/s "
                           f"-> f {profile.fetch_fraction:.3f}")

    # ---- reading -------------------------------------------------------------------------------

    def _clamp(self, f: float) -> float:
        s = self.settings
        lo, hi = max(0.0, s.fetch_fraction_min), min(1.0, s.fetch_fraction_max)
        return min(hi, max(lo, f))

    def effective_fraction(self) -> float:
        """The fraction the kernels should use now (the strategy decides for non-hybrid backends)."""
        with self._lock:
            return self._effective_locked()

    def _effective_locked(self) -> float:
        strategy = self.settings.strategy
        if strategy in ("offload", "resident"):
            return 1.0
        if strategy == "cpu":
            return 0.0
        return self._published

    def _rates_locked(self) -> tuple[float | None, float | None, dict[str, float]]:
        pcie = self._pcie.per_s
        workers = {name: r.per_s for name, r in self._cpu.items() if r.per_s}
        cpu = sum(workers.values()) if workers else None
        return pcie, cpu, workers

    def target_fraction(self) -> float | None:
        with self._lock:
            pcie, cpu, _ = self._rates_locked()
            return None if pcie is None or cpu is None else pcie / (pcie + cpu)

    def worker_shares(self) -> dict[str, float]:
        """Share of the CPU-assigned experts each measured worker should get (sums to 1)."""
        with self._lock:
            _, cpu, workers = self._rates_locked()
            return {n: r / cpu for n, r in workers.items()} if cpu else {}

    def snapshot(self) -> dict[str, Any]:
        """Everything the control plane and /metrics show (plain types; units in names)."""
        with self._lock:
            s = self.settings
            pcie, cpu, workers = self._rates_locked()
            bpe = self.expert_format.bytes_per_expert if self.expert_format else None
            gb = (lambda r: r * bpe / 1e9) if bpe else (lambda r: 0.0)
            f = self._effective_locked()
            return {
                "strategy": s.strategy, "fetch_fraction": f, "fetch_fraction_q16": fraction_to_q16(f),
                "fetch_fraction_min": s.fetch_fraction_min, "fetch_fraction_max": s.fetch_fraction_max,
                "auto_tune": s.auto_tune, "fetch_round": s.fetch_round,
                "prefetch": s.prefetch, "prefetch_budget": s.prefetch_budget,
                "target_fraction": (pcie / (pcie + cpu)) if pcie and cpu else 0.0,
                "pcie_experts_per_s": pcie or 0.0, "cpu_experts_per_s": cpu or 0.0,
                "pcie_gb_s": gb(pcie) if pcie else 0.0, "cpu_gb_s": gb(cpu) if cpu else 0.0,
                "workers": [{"name": n, "share": r / cpu, "cpu_gb_s": gb(r)} for n, r in sorted(workers.items())]
                if cpu else [],
                "wait_bias": self._wait_bias, "source": self.source, "reason": self.reason,
                "decisions_total": self.decisions_total, "telemetry_steps_total": self.telemetry_steps_total,
            }

    # ---- changing ------------------------------------------------------------------------------

    def update(self, **changes: Any) -> dict[str, Any]:
        """Set some settings (names of PolicySettings). Validates all before changing any."""
        unknown = sorted(set(changes) - set(PolicySettings.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(PolicySettings.__dataclass_fields__)}")
        with self._lock:
            candidate = PolicySettings(**{**self.settings.__dict__, **changes})
            if "fetch_fraction" in changes and "auto_tune" not in changes:
                candidate.auto_tune = False  # an operator's explicit f is not overridden by the tuner
            candidate.validate()
            self.settings = candidate
            if "fetch_fraction" in changes:
                self._fraction = self._published = self._clamp(candidate.fetch_fraction)
                self._wait_bias = 0.0
                self.source, self.reason = "set", f"fetch_fraction set to {candidate.fetch_fraction:g}"
                self.decisions_total += 1
            else:  # new bounds apply at once
                self._fraction = self._clamp(self._fraction)
                self._published = self._clamp(self._published)
        return self.snapshot()

    def observe(self, t: StepTelemetry) -> float | None:
        """Read one step's telemetry; returns the new fraction when the decision changed, else None."""
        with self._lock:
            self.telemetry_steps_total += 1
            sampled = self._pcie.add(t.experts_fetched, t.copy_time_s)
            for name, n in t.cpu_experts.items():
                rate = self._cpu.get(name)
                if rate is None:
                    rate = self._cpu[name] = _DecayedRate(self.decay)
                    self._cpu.pop("profile", None)  # measured workers replace the profile's prior
                sampled |= rate.add(n, t.cpu_time_s.get(name, 0.0))
            waits = t.gpu_wait_for_cpu_s + t.gpu_wait_for_copy_s
            if (math.isfinite(waits) and waits >= MIN_WAIT_SIGNAL_S and t.gpu_wait_for_cpu_s >= 0
                    and t.gpu_wait_for_copy_s >= 0):
                imbalance = (t.gpu_wait_for_cpu_s - t.gpu_wait_for_copy_s) / waits  # in [-1, 1]
                self._wait_bias = max(-WAIT_BIAS_LIMIT, min(WAIT_BIAS_LIMIT,
                                                           self._wait_bias + self.wait_gain * imbalance))
                sampled = True
            if not sampled or not self.settings.auto_tune or self.settings.strategy != "hybrid":
                return None
            pcie, cpu, _ = self._rates_locked()
            if pcie is None or cpu is None:
                return None  # one side never measured yet: keep f
            target = self._clamp(pcie / (pcie + cpu) + self._wait_bias)
            self._fraction = self._clamp(self._fraction + self.gain * (target - self._fraction))
            if abs(self._fraction - self._published) < DECISION_STEP:
                return None
            self._published = self._fraction
            self.decisions_total += 1
            self.source = "online"
            self.reason = (f"online: {pcie:.1f} fetched/s, {cpu:.1f} CPU experts/s, wait bias "
                           f"{self._wait_bias:+.3f} -> target {target:.3f}")
            return self._published


def build_policy(settings: PolicySettings, *, fraction_given: bool, benchbw_path: str = "",
                 expert_format: ExpertFormat | None = None, gpu_name: str = "") -> FetchPolicy:
    """The policy `ft serve` starts with: a given fraction wins, then a matching profile, then 0.5."""
    if fraction_given:
        return FetchPolicy(settings, expert_format=expert_format, source="flag")
    profile = None
    if expert_format is not None and gpu_name:
        profile = load_bandwidth_profile(benchbw_path or default_benchbw_path(), expert_format, gpu_name)
    return FetchPolicy(settings, expert_format=expert_format, profile=profile)
