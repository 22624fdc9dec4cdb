"""Simulated expert-cache misses per decode token under eviction policies, on the benchmarks' synthetic routing.

A simulation, not a measurement: no GPU, no copies. It replays what `bench_engine.py` does to the slot cache (one
global pool; a prefill pass that copies every expert of every layer in layer order; then decode tokens, each layer
routing K distinct experts from `SyntheticRouting`'s table) under:

- `lru`: the slot-cache contract's eviction key (docs/slot_cache.md): the slot least recently used. On the H200
  the engine measured 288.4 / 166.6 / 87.2 misses a token at 10 / 25 / 50% caches (docs/OFFLOAD.md); this simulation gives 288.6 / 166.4 / 87.0 (the kernel orders a call's misses by
  recency and breaks ties by slot index, which this replay approximates), which is what makes the others worth
  reading.
- `lfu`: evict the resident expert routed the fewest times so far (prompt and decode routes counted), ties to the
  least recently used: a frequency key the contract does not have.
- `pin:X`: a share X of the slots keeps the experts the prompt routed most (a static choice made after prefill),
  the rest is LRU.
- `w:W` or `w:W:H`: the kernels' frequency-weighted key (`SlotCache.freq_weight` = W, docs/slot_cache.md): last use
  (in layer calls) + W x the routes the expert has had, every count halved after each H-th layer call
  (`freq_half_life`; none without H); `w:0` is LRU.

The synthetic table draws every position's experts independently from a fixed skewed popularity per layer, so
frequency predicts the future perfectly here and recency adds nothing: `lfu` is close to the best any policy can
do on it. Real routing drifts and repeats across neighbouring tokens, which LRU captures and a pure count does
not; what a frequency-aware key is worth on a real checkpoint has to be measured on one.

Usage: python bench/sim_eviction.py [--fractions 0.1,0.25,0.5] [--policies lru,lfu,pin:0.5,pin:1.0]
       [--preset qwen3-30b-a3b] [--prompt-tokens 1024] [--decode-tokens 256] [--skew 1.0]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ftexpert.gpu_worker.checkpoint.presets import preset_config  # noqa: E402
from ftexpert.gpu_worker.models.synthetic_routing import SyntheticRouting  # noqa: E402
from ftexpert.gpu_worker.backends.offload import resolve_cache_slots  # noqa: E402


def simulate(table, num_layers: int, num_experts: int, slots: int, prompt: int, decode: int, policy: str) -> float:
    """Misses per decode token. table [positions, layers, K] of expert ids (SyntheticRouting.table)."""
    return simulate_requests([table], num_layers, num_experts, slots, prompt, decode, policy)[0]


def simulate_requests(tables, num_layers: int, num_experts: int, slots: int, prompt: int, decode: int,
                      policy: str) -> list[float]:
    """Misses per decode token of each request, one after another on the same pool (its counts and recency carry
    over, as in a serving engine): each request is a prefill pass over every expert and `decode` tokens, its routes
    from its own table. Tables from different seeds model a workload whose popular experts drift between requests.
    `pin:X` pins by the first request's prompt."""
    counts: collections.Counter = collections.Counter()
    lru: collections.OrderedDict = collections.OrderedDict()     # resident (layer, expert), least recent first
    weight = int(policy.split(":")[1]) if policy.startswith("w:") else None
    half_life = int(policy.split(":")[2]) if policy.startswith("w:") and policy.count(":") == 2 else 0
    last: dict = {}                                 # w:W: the layer call of each resident expert's last use
    pinned: set = set()
    step = 0
    capacity = slots

    def admit(key, used_now: set) -> None:
        if capacity <= 0:
            return
        if len(lru) >= capacity:
            if policy == "lfu":      # fewest routes, ties to the least recent (the OrderedDict's order)
                victim = min(lru, key=lambda k: counts[k])
            elif weight is not None:     # smallest last use + W x routes, among experts not used in this call
                victim = min((k for k in lru if k not in used_now), key=lambda k: last[k] + weight * counts[k])
            else:
                victim = next(iter(lru))
            del lru[victim]
        lru[key] = True
        last[key] = step

    def age() -> None:
        """The kernels' aging, after a call whose step is a multiple of the half-life (victims chosen before it)."""
        if half_life and step % half_life == 0:
            for key in counts:
                counts[key] >>= 1

    per_request = []
    for r, table in enumerate(tables):
        for layer in range(num_layers):
            counts.update((layer, e) for e in table[:prompt, layer].reshape(-1).tolist())
        if r == 0 and policy.startswith("pin:"):
            pinned = {key for key, _ in counts.most_common(int(float(policy[4:]) * slots))}
            capacity = slots - len(pinned)
        for layer in range(num_layers):             # the prefill pass: every expert copied, in layer order
            step += 1
            for e in range(num_experts):
                if (layer, e) not in pinned:
                    lru.pop((layer, e), None)
                    admit((layer, e), set())
            age()
        misses = 0
        for pos in range(prompt, prompt + decode):
            for layer in range(num_layers):
                step += 1
                routed = {(layer, e) for e in table[pos, layer].tolist()}
                counts.update(routed)
                for key in routed:                  # hits first (ensure marks them before choosing victims)
                    if key in lru:
                        lru.move_to_end(key)
                        last[key] = step
                for key in sorted(routed):
                    if key not in lru and key not in pinned:
                        misses += 1
                        admit(key, routed)
                age()
        per_request.append(misses / decode)
    return per_request


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--fractions", default="0.1,0.25,0.5")
    parser.add_argument("--policies", default="lru,lfu,pin:0.5,pin:1.0")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--skew", type=float, default=1.0, help="the routing's zipf skew (bench_engine's zipf:SKEW)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routing", default=None,
                        help="trace:FILE: a trained model's recorded routes instead of zipf (bench_engine's --routing)")
    parser.add_argument("--requests", type=int, default=1,
                        help="requests one after another on the same pool, each with its own popularity (seeds seed, "
                             "seed+1, ...): how each key follows a drift; the table shows the last request's misses")
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in ("lru", "lfu") and not (p.startswith("pin:") and 0.0 <= float(p[4:]) <= 1.0) \
                and not (p.startswith("w:") and all(x.isdigit() for x in p.split(":")[1:]) and p.count(":") <= 2):
            raise SystemExit(f"--policies takes lru, lfu, pin:X with 0 <= X <= 1, w:W and w:W:H (W, H >= 0), got {p!r}")
    cfg = preset_config(args.preset)
    positions = args.prompt_tokens + args.decode_tokens
    if args.routing:
        if not args.routing.startswith("trace:"):
            raise SystemExit(f"--routing {args.routing!r}: give trace:FILE (zipf is --skew)")
        tables = [SyntheticRouting.parse(args.routing, cfg, positions, "cpu").table]
    else:
        tables = [SyntheticRouting(cfg.num_layers, cfg.num_experts, cfg.top_k, positions,
                                   skew=args.skew, seed=args.seed + r).table for r in range(max(1, args.requests))]
    routing = args.routing or f"zipf:{args.skew:g} (seed {args.seed})"
    print(f"{args.preset}: {cfg.num_layers} layers x {cfg.num_experts} experts, top-{cfg.top_k}; prompt "
          f"{args.prompt_tokens}, {args.decode_tokens} decode tokens, routing {routing}; "
          f"misses per decode token (simulated)"
          + (f", of the last of {len(tables)} requests with different popularity" if len(tables) > 1 else ""))
    print(f"{'cache':>6} {'slots':>6} " + " ".join(f"{p:>9}" for p in policies))
    for frac in (float(f) for f in args.fractions.split(",") if f.strip()):
        slots = resolve_cache_slots(frac, cfg.num_layers, cfg.num_experts)
        row = [simulate_requests(tables, cfg.num_layers, cfg.num_experts, slots, args.prompt_tokens,
                                 args.decode_tokens, p)[-1] for p in policies]
        print(f"{frac:>6.0%} {slots:>6} " + " ".join(f"{m:>9.1f}" for m in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
