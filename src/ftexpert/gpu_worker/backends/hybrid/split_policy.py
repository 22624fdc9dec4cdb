"""`SplitPolicy`: how the hybrid backend splits a layer's misses between PCIe fetches and the CPU pool, as it stands.

The policy is a dict of strategy (hybrid: f as given; cpu: f = 0, no promotion; offload: f = 1), fetch_fraction
f, fetch_round, promote and seed. `apply` validates a change and writes the slot cache's device policy tensor, which
`ensure` reads (use_device_policy: a captured CUDA graph follows live changes); `adopt` then makes it the current
policy. Under fetch_round "split", which rounds down so that the device hand-off can split one more expert by
channels, `unsplit` holds the explicit ensure arguments of the host hand-off (prefill, eager calls: never captured),
which cannot split and rounds as min-wait. `fetch_fraction_source` says where the starting f came from (the backend
factory sets it: "flag", "default", "profile:PATH", "strategy cpu"; "given" otherwise).
"""
from __future__ import annotations

from ftexpert.kernels.slot_cache import SlotCache, set_policy

STRATEGIES = ("hybrid", "cpu", "offload")     # what set_policy(strategy=...) may switch between


class SplitPolicy:
    """The policy of one backend over its slot cache `cache`; starts empty (the backend applies its first one)."""

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.policy: dict = {}
        self.strategy = "hybrid"
        self.unsplit: dict | None = None         # the host hand-off's ensure arguments under "split" (else None)
        self.fetch_fraction_source = "given"

    def apply(self, *, strategy: str | None = None, fetch_fraction: float | None = None, fetch_round: str | None = None,
              promote: bool | None = None, seed: int | None = None) -> dict:
        """The policy with the given fields changed (None: unchanged), validated and written to the device policy
        tensor and `unsplit`; returns it for `adopt`. Raises ValueError, writing nothing, on a bad value."""
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"this backend switches between {', '.join(STRATEGIES)}, not {strategy!r} "
                             f"(resident needs a restart with --moe-strategy resident)")
        p = dict(self.policy)
        for key, value in (("strategy", strategy), ("fetch_fraction", fetch_fraction), ("fetch_round", fetch_round),
                           ("promote", promote), ("seed", seed)):
            if value is not None:
                p[key] = value
        fraction, promote_now = float(p["fetch_fraction"]), bool(p["promote"])
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fetch_fraction must be within [0, 1], got {fraction!r}")
        if p["strategy"] == "cpu":
            fraction, promote_now = 0.0, False
        elif p["strategy"] == "offload":
            fraction = 1.0
        set_policy(self.cache, fetch_fraction=fraction, round_mode=p["fetch_round"],
                   promote=promote_now, seed=int(p["seed"]))          # validates before writing
        # "split" rounds down so that the device path can split one more expert by channels; the host path
        # (prefill, eager: never captured), which cannot split, rounds it as min-wait (explicit values). On the
        # device path an expert too small to split (splittable) is left at floor.
        self.unsplit = None if p["fetch_round"] != "split" else dict(
            fetch_fraction=fraction, round_mode="min-wait", promote=promote_now,
            seed=int(p["seed"]))
        return p

    def adopt(self, p: dict) -> None:
        """Make `p` (from `apply`) the current policy."""
        self.policy = p
        self.strategy = p["strategy"]
