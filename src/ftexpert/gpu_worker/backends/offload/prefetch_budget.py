"""The `auto` lookahead prefetch's budget rule (docs/PREFETCH.md "auto"): how many of a layer's ranked candidates to
prefetch, from measured times only. Pure Python (no torch): the rule is unit-tested on tables and recorded timings.

The prefetch for layer L is copied on the link behind layer L-1's demand copy; layer L's demand copy can start once
the compute stream reaches ensure(L). The link's idle window W_L is the time between the two (the end of L-1's
demand copy to ensure(L): L-1's remaining GEMMs, L's attention and router; in hybrid also the wait for the CPU
share). A copy of one expert takes t = expert_bytes / bandwidth. Candidate i (0-based, in the predictor's rank
order among the candidates not resident) would occupy the link over [i t, (i + 1) t] after the window opens, so the
hidden share of its copy is h_i = clamp((W - i t) / t, 0, 1); the rest, (1 - h_i) t, delays layer L's demand copy
(the compute stream joins the prefetch before it).

With p_i the probability that candidate i is routed by layer L (the measured precision at that rank), its expected
gain in seconds off the step is

    gain_i = p_i s t  -  (1 - h_i) t  -  (1 - p_i) c s t

- a right guess saves a demand copy of the same bytes: s t, where s is the share of a miss's cost that lies on
  the critical path (offload: s = 1; hybrid: s = the fetch fraction f, since a miss the split policy sends to the
  CPU costs the layer what a fetched one does when the split is balanced, and removing any miss shortens both
  sides' queues by its share; strategy cpu: s = 0);
- every guess, right or wrong, costs the part of its copy that is not hidden;
- a wrong guess may also evict an expert that is routed again later (the usage-0 slot it leaves is the next
  demand miss's victim, so most wrong guesses evict nothing extra): c s t, c = `victim_cost`.

gain_i > 0  <=>  p_i > (1 - h_i + c s) / (s (1 + c)), the precision break-even. A fully hidden copy (h = 1) needs
p > c / (1 + c) (0.2 with c = 0.25); one not hidden at all (h = 0) would need p > 1: never. So the count is the
longest prefix of the candidates whose every member clears its break-even; it is 0 where the link has no idle
window. `OnlineBudget` keeps the measurements (EWMA per layer) and applies the rule per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

DEFAULT_VICTIM_COST = 0.25     # c: the expected cost of a wrong guess's eviction, in demand copies
DEFAULT_ALPHA = 0.3            # EWMA weight of a new sample (one per layer every timed step)


def break_even(hidden: float, saved: float = 1.0, victim_cost: float = DEFAULT_VICTIM_COST) -> float:
    """The precision p above which a candidate whose copy is `hidden` (0..1) inside the idle window gains:
    (1 - hidden + c s) / (s (1 + c)). Above 1 (never) when s <= 0 or nothing is hidden."""
    if saved <= 0.0:
        return float("inf")
    hidden = min(max(hidden, 0.0), 1.0)
    return (1.0 - hidden + victim_cost * saved) / (saved * (1.0 + victim_cost))


def hidden_share(i: int, idle_s: float, copy_s: float) -> float:
    """The share of candidate i's copy (the i-th on the link after the window opens) that lies inside it."""
    if copy_s <= 0.0:
        return 0.0
    return min(max((idle_s - i * copy_s) / copy_s, 0.0), 1.0)


def prefetch_count(idle_s: float, bandwidth: float, expert_bytes: int, probs: Sequence[float], *,
                   saved: float = 1.0, victim_cost: float = DEFAULT_VICTIM_COST, cap: int | None = None) -> int:
    """The number of candidates to prefetch: the longest prefix of `probs` (each candidate's probability of being
    routed, in the order they would be copied) whose members all clear their break-even (module docstring).
    idle_s: the link's idle window (s); bandwidth: bytes/s of the link; expert_bytes: one expert's copy; saved: s;
    cap: at most this many (None: len(probs))."""
    if idle_s <= 0.0 or bandwidth <= 0.0 or expert_bytes <= 0 or saved <= 0.0:
        return 0
    copy_s = expert_bytes / bandwidth
    limit = len(probs) if cap is None else min(cap, len(probs))
    n = 0
    while n < limit and probs[n] > break_even(hidden_share(n, idle_s, copy_s), saved, victim_cost):
        n += 1
    return n


def expected_gain_s(n: int, idle_s: float, bandwidth: float, expert_bytes: int, probs: Sequence[float], *,
                    saved: float = 1.0, victim_cost: float = DEFAULT_VICTIM_COST) -> float:
    """Expected seconds the first `n` candidates take off a layer call (the sum of gain_i)."""
    if n <= 0 or bandwidth <= 0.0:
        return 0.0
    t = expert_bytes / bandwidth
    return sum(p * saved * t - (1.0 - hidden_share(i, idle_s, t)) * t - (1.0 - p) * victim_cost * saved * t
               for i, p in enumerate(probs[:n]))


@dataclass
class Ewma:
    """An exponentially weighted mean and mean absolute deviation; the first sample sets the mean."""
    alpha: float = DEFAULT_ALPHA
    mean: float = 0.0
    dev: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        if self.samples == 0:
            self.mean, self.dev = x, 0.0
        else:
            self.dev += self.alpha * (abs(x - self.mean) - self.dev)
            self.mean += self.alpha * (x - self.mean)
        self.samples += 1

    def low(self) -> float:
        """A cautious value: the mean less its deviation (0 before any sample)."""
        return self.mean - self.dev if self.samples else 0.0


@dataclass
class OnlineBudget:
    """The measurements `auto` decides from, per target layer (EWMA, `alpha` a sample), and the rule applied to them.

    - `observe_window(layer, seconds)`: the link's idle window before `layer` (ready(L) - demand end(L-1));
      negative when the compute stream reached ensure(L) before the link was free.
    - `observe_join(layer, seconds)`: how long the compute stream would have waited at ensure(layer) for that
      layer's prefetch copy (prefetch end - ready; <= 0: it had landed). The window used is cut by its mean, so a
      rule that overfills a window shrinks it.
    - `observe_bandwidth(bytes, seconds)`: copies measured on the link.
    - `observe_ranks(layer, seen, hits)`: per rank among the non-resident candidates, how often that rank was
      seen and routed since the last call; the rate is that rank's precision.
    `budgets(saved)` gives each layer's count (layer 0, never predicted: 0). Before a layer's window, the bandwidth
    or a rank's precision is measured, that layer's count is 0: a cold start prefetches nothing."""
    num_layers: int
    k: int
    expert_bytes: int
    alpha: float = DEFAULT_ALPHA
    victim_cost: float = DEFAULT_VICTIM_COST
    windows: list[Ewma] = field(init=False)
    joins: list[Ewma] = field(init=False)
    precision: list[list[Ewma]] = field(init=False)
    bandwidth: Ewma = field(init=False)

    def __post_init__(self) -> None:
        self.windows = [Ewma(self.alpha) for _ in range(self.num_layers)]
        self.joins = [Ewma(self.alpha) for _ in range(self.num_layers)]
        self.precision = [[Ewma(self.alpha) for _ in range(self.k)] for _ in range(self.num_layers)]
        self.bandwidth = Ewma(self.alpha)

    def observe_window(self, layer: int, seconds: float) -> None:
        self.windows[layer].add(seconds)

    def observe_join(self, layer: int, seconds: float) -> None:
        self.joins[layer].add(max(seconds, 0.0))

    def observe_bandwidth(self, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth.add(nbytes / seconds)

    def observe_ranks(self, layer: int, seen: Sequence[int], hits: Sequence[int]) -> None:
        for r, (s, h) in enumerate(zip(seen[:self.k], hits[:self.k])):
            if s > 0:
                self.precision[layer][r].add(h / s)

    def idle_s(self, layer: int) -> float:
        """The window the rule uses: the mean less its deviation, less the mean join wait (0 unmeasured)."""
        w = self.windows[layer]
        if not w.samples:
            return 0.0
        return max(0.0, w.low() - self.joins[layer].mean)

    def probs(self, layer: int) -> list[float]:
        """Each rank's measured precision, up to the first rank not measured yet."""
        out = []
        for e in self.precision[layer]:
            if not e.samples:
                break
            out.append(min(max(e.mean, 0.0), 1.0))
        return out

    def budget(self, layer: int, saved: float = 1.0, cap: int | None = None) -> int:
        if layer == 0 or not self.bandwidth.samples:
            return 0
        return prefetch_count(self.idle_s(layer), self.bandwidth.mean, self.expert_bytes, self.probs(layer),
                              saved=saved, victim_cost=self.victim_cost, cap=cap)

    def budgets(self, saved: float = 1.0, cap: int | None = None) -> list[int]:
        return [self.budget(layer, saved, cap) for layer in range(self.num_layers)]

    def window_fits(self, fraction: float = 0.5) -> bool:
        """Whether some layer's window holds at least `fraction` of one expert's copy: whether predicting is
        worth running at all (where it does not, `auto` runs no predictor)."""
        if not self.bandwidth.samples:
            return False
        t = self.expert_bytes / self.bandwidth.mean
        return any(self.idle_s(layer) >= fraction * t for layer in range(1, self.num_layers))

    def expected_gain_s(self, saved: float = 1.0, cap: int | None = None) -> float:
        """Expected seconds the rule's choice takes off one decode step (summed over layers)."""
        if not self.bandwidth.samples:
            return 0.0
        total = 0.0
        for layer in range(1, self.num_layers):
            n = self.budget(layer, saved, cap)
            total += expected_gain_s(n, self.idle_s(layer), self.bandwidth.mean, self.expert_bytes,
                                     self.probs(layer), saved=saved, victim_cost=self.victim_cost)
        return total
