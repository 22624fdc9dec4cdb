"""Decode benchmark of the miss strategies side by side: offload, cpu, hybrid (3 rounding modes x
promotion on/off), on one GPU with one CPU expert pool; plus the hand-off round trip.

qwen3-30b-a3b preset (seeded random weights, bf16), batch 1, a cache of 25% of all experts, a
--prompt-tokens prompt, --decode-tokens decode tokens, median of --runs runs after a warm-up run.
One host expert store and one CPU pool serve every backend; on a CUDA GPU the cpu and hybrid rows hand the
CPU share over by the device kernels inside the decode CUDA graph (DeviceDoorbell), on a CPU machine on the
host (submit/join). Per backend: decode tok/s, misses,
fetched and CPU-computed experts per token, fallbacks, and the roofline
    tok/s <= (B_pcie + B_cpu) / (misses/token * expert_bytes)
with B_pcie and B_cpu measured here first (gpu_worker/backends/hybrid/bandwidth.py, as `ft bench bw`), each alone;
then both at once (shared_bandwidth: the two share the host DRAM), whose combined figure (the bytes both
moved together a second) gives the "shared roofline" column beside it.
Greedy tokens are compared with the resident run's (offload must match; cpu/hybrid compute misses
with the CPU kernel, whose bf16 accumulation order differs: a late divergence is expected there). The engines' prefix
cache is off unless --prefix-cache on: every run prefills the whole prompt and starts its decode from the same state.
--prefetch-budgets B,...: every variant also with the lookahead prefetch on at each budget (rows "NAME prefetchB";
"auto": the auto prefetch, rows "NAME prefetchauto"; their JSON rows carry the prefetch counters over the warm-up
and the runs, and auto's what the rule saw at the end).
Then the hand-off round trip GPU -> CPU process -> GPU (hidden state down, a 0-triple request through
the channel, the zero partial sum up, synchronised) p50/p99 over --handoff-calls calls.

Every engine is built by `build_engine(spec)`: each row's backend (its strategy, cache, copy, eviction key and
prefetch in the spec; f, rounding and promotion in HybridOptions) over the first build's dense weights
(`reuse=`), the one host store and the one CPU pool (`Attachment(host=..., pool=...)`).

    python bench/bench_hybrid.py                                   # on the H200
    python bench/bench_hybrid.py --preset tiny --device cpu --runs 1 --decode-tokens 16 \\
        --prompt-tokens 16 --handoff-calls 500                      # smoke test on a CPU machine
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ftexpert.gpu_worker.api import Attachment, Engine, SamplingParams, build_engine, open_model_source  # noqa: E402
from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources  # noqa: E402
from ftexpert.cpu_expert_pool.api import worker_flags as cpu_worker_flags  # noqa: E402
from ftexpert.gpu_worker.api import attach_cpu_pool  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid import HybridExperts, HybridOptions  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid.bandwidth import copy_bandwidth, cpu_pool_bandwidth, shared_bandwidth  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid.options import device_name  # noqa: E402
from ftexpert.proto.engine_spec import EngineSpec, spec_from_args  # noqa: E402
from ftexpert.proto.knobs import EXPERT_FORMAT_CHOICES  # noqa: E402
from ftexpert.gpu_worker.backends.offload import HostExperts, resolve_cache_slots  # noqa: E402

ROUNDS = ("min-wait", "stochastic", "prefer-fetch", "split")   # split: floor on the host paths
BW_CALLS = 100


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _counters(backend) -> dict:
    """misses, fetched, cpu experts, fallbacks so far (offload: its OffloadStats). fetched counts the split
    experts' GPU channels (fetch_round split) as fractions of an expert; splits: experts split."""
    if isinstance(backend, HybridExperts):
        c = backend.counters()
        split_fetched = c["split_gpu_channels_total"] / backend.layout.intermediate_size
        return {"misses": c["expert_misses_total"], "fetched": c["experts_fetched_total"] + split_fetched,
                "splits": c["split_experts_total"],
                "cpu": c["cpu_experts_total"], "fallbacks": c["fallbacks_total"],
                "wait_cpu_s": c["gpu_wait_for_cpu_s_total"], "wait_copy_s": c["gpu_wait_for_copy_s_total"],
                "cpu_time_s": c["cpu_expert_time_s_total"]}
    if backend is None:
        return {}
    s = backend.refresh_stats()     # the kernel copy mode counts on the device
    return {"misses": s.distinct_misses, "fetched": s.fetched, "cpu": 0, "fallbacks": 0}


def decode_run(engine: Engine, prompt: list[int], num_tokens: int, backend, device: torch.device,
               tick=None) -> dict:
    """One request: prefill, then decode; counters of the decode phase only. `tick()` (the live tuner) runs
    after every engine step (the decode steps' ticks inside the timed stretch), as the service's loop does."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=num_tokens, ignore_eos=True))
    tokens: list[int] = []
    while not tokens:                                   # prefill (chunks) up to the first token
        tokens += [out.new_token_id for out in engine.step()]
        if tick is not None:
            tick()
    before = _counters(backend)
    _sync(device)
    t0 = time.perf_counter()
    while engine.has_work():
        tokens += [out.new_token_id for out in engine.step()]
        if tick is not None:
            tick()
    _sync(device)
    elapsed = time.perf_counter() - t0
    n = len(tokens) - 1
    after = _counters(backend)
    result = {"tokens": tokens, "decode_tok_s": n / elapsed}
    result.update({f"{k}_per_token": (after[k] - before[k]) / n for k in after})
    return result


def live_tuner(engine: Engine, backend, fraction: float, pcie_gb_s: float, cpu_gb_s: float, gpu: str,
               fraction_given: bool = False):
    """The coordinator's online policy (coordinator/policy.py), driven as EngineService drives it: after each
    engine step (prefill chunks too, as the service reads stats after every step), telemetry from two
    snapshots of engine.stats, `FetchPolicy.observe`, and a changed f goes to the engine. It starts where
    `build_policy` would: at a given --fetch-fraction, else at this run's probes used as the bandwidth
    profile. The tuner keeps its state across the warm-up and the measured runs. -> tick."""
    from ftexpert.coordinator.engine_service import telemetry_from_stats
    from ftexpert.coordinator.policy import FetchPolicy, PolicySettings
    from ftexpert.proto.bandwidth_profile import BandwidthProfile, ExpertFormat
    from ftexpert.proto.engine_messages import flatten_stats
    layout = backend.layout
    fmt = ExpertFormat(str(layout.dtype), layout.hidden_size, layout.intermediate_size)
    profile = BandwidthProfile(pcie_gb_s, cpu_gb_s, gpu, fmt, "bench_hybrid probes")
    p = backend.policy
    policy = FetchPolicy(PolicySettings(strategy="hybrid", fetch_fraction=fraction, fetch_round=p["fetch_round"]),
                         expert_format=fmt,
                         profile=None if fraction_given else profile)
    prev: dict = {}
    engine.set_policy(fetch_fraction=policy.effective_fraction())    # where the service starts it too

    def tick() -> None:
        nonlocal prev
        cur = flatten_stats(engine.stats)
        if prev:
            telemetry = telemetry_from_stats(prev, cur)
            if telemetry is not None and (f := policy.observe(telemetry)) is not None:
                engine.set_policy(fetch_fraction=f, cpu_shares=policy.worker_shares())
        prev = cur
    return tick


def measure(engine, prompt, args, backend, device, tick=None) -> dict:
    decode_run(engine, prompt, min(args.decode_tokens, 32), backend, device, tick)       # warm-up
    runs = [decode_run(engine, prompt, args.decode_tokens, backend, device, tick) for _ in range(args.runs)]
    best = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]         # the median run
    best["all_tok_s"] = [round(r["decode_tok_s"], 2) for r in runs]
    return best


def median_rounds(by_variant: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """One row per variant run in several rounds: the round whose decode rate is the median (the upper of the
    two middle ones for an even count; its figures whole, not mixed from several rounds), with every round's
    median rate in `rounds_tok_s`."""
    out = []
    for base, results in by_variant.items():
        pick = dict(sorted(results, key=lambda r: r["decode_tok_s"])[len(results) // 2])
        pick["rounds_tok_s"] = [round(r["decode_tok_s"], 2) for r in results]
        out.append((f"{base} (median of {len(results)} rounds)", pick))
    return out


def handoff_round_trip(pool, hidden: int, dtype: torch.dtype, device: torch.device, calls: int) -> dict:
    """GPU -> CPU process -> GPU: x [1, H] down to pinned memory, a 0-triple request through worker 0's
    channel, its partial sum [1, H] fp32 up, added on the device, synchronised. p50/p99 in us."""
    client = pool.members[0].client
    pin = device.type == "cuda"
    x = torch.randn(1, hidden, device=device).to(dtype)
    staged = torch.empty(1, hidden, dtype=torch.bfloat16 if pool.hidden_dtype == "bfloat16" else torch.float32,
                         pin_memory=pin)
    partial_host = torch.empty(1, hidden, dtype=torch.float32, pin_memory=pin)
    empty = (np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.float32))
    samples = []
    for i in range(calls + calls // 10):
        t0 = time.perf_counter_ns()
        staged.copy_(x, non_blocking=True)
        _sync(device)
        client.submit(i % 2, staged, empty)
        partial_host.copy_(client.wait(i % 2, deadline_s=10.0))
        y = x.float() + partial_host.to(device, non_blocking=True)
        _sync(device)
        samples.append(time.perf_counter_ns() - t0)
    del y
    arr = np.asarray(samples[calls // 10:], dtype=np.float64) / 1e3
    return {"calls": len(arr), "p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)),
            "max_us": float(arr.max())}


TABLE_HEADER = (f"{'backend':<28} {'tok/s':>7} {'miss/tok':>8} {'fetch/tok':>9} {'cpu/tok':>7} {'roofline':>8} "
                f"{'%roof':>5} {'shared roof':>11} {'%shr':>5} {'fallbk':>6} {'cpu ms/tok':>10} {'wait ms/tok':>11} "
                f"{'same tokens':>11} {'f':>5}")


def shared_summary(shared) -> str:
    return shared.summary() if shared is not None else "not measured (the shared probe failed)"


def table_row(name: str, r: dict, both_bytes_s: float, shared_bytes_s: float, expert_bytes: int) -> str:
    """One line of the final table (also printed as each backend finishes: a cut-off run keeps its rows).
    both_bytes_s: B_pcie + B_cpu measured apart; shared_bytes_s: the bytes both moved together a second."""
    miss = r.get("misses_per_token")
    roof = both_bytes_s / (miss * expert_bytes) if miss else float("nan")
    pct = 100 * r["decode_tok_s"] / roof if miss else float("nan")
    shared_roof = shared_bytes_s / (miss * expert_bytes) if miss else float("nan")
    shared_pct = 100 * r["decode_tok_s"] / shared_roof if miss else float("nan")
    same = "-" if r.get("same_tokens") is None else ("yes" if r["same_tokens"] else f"from {r['first_diff']}")
    return (f"{name:<28} {r['decode_tok_s']:>7.2f} {(miss or 0):>8.1f} {r.get('fetched_per_token', 0):>9.1f} "
            f"{r.get('cpu_per_token', 0):>7.1f} {roof:>8.2f} {pct:>5.0f} {shared_roof:>11.2f} {shared_pct:>5.0f} "
            f"{r.get('fallbacks_per_token', 0):>6.2f} "
            f"{1e3 * r.get('cpu_time_s_per_token', 0):>10.2f} {1e3 * r.get('wait_cpu_s_per_token', 0):>11.2f} "
            f"{same:>11} {r['fetch_fraction'] if 'fetch_fraction' in r else float('nan'):>5.3f}")


def variants(args) -> list[tuple[str, dict | None]]:
    out: list[tuple[str, dict | None]] = [("offload", {"strategy": "offload"}), ("cpu", {"strategy": "cpu"})]
    for promote in (True, False):
        for rnd in ROUNDS:
            out.append((f"hybrid {rnd}{'' if promote else ' no-promo'}",
                        {"strategy": "hybrid", "fetch_round": rnd, "promote": promote}))
    # each planned expert copied whole (one part), against the default w13-then-w2 copy
    out.append(("offload whole-copy", {"strategy": "offload", "split_copy": False}))
    out.append(("hybrid min-wait whole-copy", {"strategy": "hybrid", "fetch_round": "min-wait",
                                               "promote": True, "split_copy": False}))
    # the coordinator's online tuner moving f from the probes' value while it decodes
    out.append(("hybrid min-wait tuned", {"strategy": "hybrid", "fetch_round": "min-wait", "promote": True,
                                          "tune": True}))
    out.append(("hybrid split tuned", {"strategy": "hybrid", "fetch_round": "split", "promote": True,
                                       "tune": True}))
    # f from the shared probe (both sides reading host DRAM at once) instead of the separate ones: "shared" is
    # resolved in main once the probe has run (the probes' f when it failed)
    out.append(("hybrid split shared-f", {"strategy": "hybrid", "fetch_round": "split", "promote": True,
                                          "fetch_fraction": "shared"}))
    for f in filter(None, (v.strip() for v in args.extra_fractions.split(","))):
        for rnd in ("min-wait", "split"):
            out.append((f"hybrid {rnd} f={float(f):.3g}", {"strategy": "hybrid", "fetch_round": rnd,
                                                          "promote": True, "fetch_fraction": float(f)}))
    if args.variants:
        keep = [v.strip() for v in args.variants.split(",")]
        out = [v for v in out if any(v[0].startswith(k) if not k.startswith("=") else v[0] == k[1:] for k in keep)]
    budgets = [b.strip() if b.strip() == "auto" else int(b) for b in args.prefetch_budgets.split(",") if b.strip()]
    if budgets:                 # each variant also with the lookahead prefetch on at each budget ("... prefetch4")
        out += [(f"{n} prefetch{b}", {**p, "prefetch": b}) for n, p in out for b in budgets]
    weights = freq_weights(args.freq_weights)
    if weights != [None]:       # each variant once per eviction weight W, side by side ("... fw256"; 0: LRU)
        out = [(f"{n} fw{w}", {**p, "freq_weight": w}) for n, p in out for w in weights]
    return out


def row_spec(base: EngineSpec, policy: dict, args, fraction: float, shared, pdl_mode: str | None):
    """A row's engine spec (its strategy, expert copy, eviction key, prefetch and PDL over `base`), its HybridOptions
    (cpu / hybrid: f, rounding, promotion; `fraction`: the probes' f unless the row names one, "shared": the shared
    probe's), whether the live tuner drives it, and its prefetch budget (0: off)."""
    from ftexpert.gpu_worker.backends.hybrid import HybridOptions

    policy = dict(policy)
    budget = policy.pop("prefetch", 0)
    fields = dict(moe_strategy=policy.pop("strategy"),
                  expert_copy="split" if policy.pop("split_copy", True) else "whole",
                  moe_prefetch="auto" if budget == "auto" else "on" if budget else "off",
                  moe_prefetch_budget=budget if isinstance(budget, int) and budget else base.moe_prefetch_budget,
                  pdl=pdl_mode or base.pdl)
    weight = policy.pop("freq_weight", None)
    if weight is not None:
        fields["eviction_freq_weight"] = weight
    if args.freq_half_life is not None:
        fields["eviction_freq_half_life"] = args.freq_half_life
    tune, hybrid = False, None
    if fields["moe_strategy"] == "cpu" and getattr(args, "cpu_cache", ""):
        fields["moe_cache_size"] = args.cpu_cache
    if fields["moe_strategy"] != "offload":
        policy = {"fetch_fraction": fraction, **policy}     # named rows say otherwise
        if policy["fetch_fraction"] == "shared":
            policy["fetch_fraction"] = shared.fetch_fraction if shared is not None else fraction
        tune = policy.pop("tune", False)
        hybrid = HybridOptions(**policy)
    return dataclasses.replace(base, **fields), hybrid, tune, budget


def freq_weights(text: str) -> list[int | None]:
    """--freq-weights: the eviction weights W to run every variant with; [None] (the knob's) when not given."""
    weights = [int(w) for w in text.split(",") if w.strip()]
    if any(w < 0 for w in weights):
        raise SystemExit(f"--freq-weights {text!r}: weights are integers >= 0 (0: LRU)")
    return weights or [None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--expert-format", default="auto", choices=EXPERT_FORMAT_CHOICES,
                        help="the experts' format (auto: the preset's: bf16, mxfp4 for gpt-oss; quantized while loading otherwise)")
    parser.add_argument("--dtype", default="auto", help="auto: the preset's (bf16 for qwen3-30b-a3b)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--cache", default="0.25", help="GPU expert slots: a fraction of all experts, or a count")
    parser.add_argument("--cpu-cache", default="",
                        help="the cpu rows' GPU expert slots (a fraction or a count; default: --cache), so that one run "
                             "measures cpu at its smallest cache beside hybrid at --cache over one host store")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--fetch-fraction", type=float, default=None,
                        help="hybrid's f (default: B_pcie / (B_pcie + B_cpu) measured here)")
    parser.add_argument("--cpu-workers", type=int, default=1)
    parser.add_argument("--cpu-threads", type=int, default=0, help="0: one per physical core")
    parser.add_argument("--pdl", choices=("auto", "on", "off", "both"), default=None,
                        help="programmatic dependent launch of the decode kernels (FREETOKEN_PDL, kernels/pdl.py); "
                             "default: as FREETOKEN_PDL says; both: every variant with it off, then on, side by side")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of variants this many times over, in turn (A B A B ...: a drift of the "
                             "host's CPU side, which moves hybrid rows by +-10%% between minutes, hits every variant "
                             "alike); then one more row per variant: its median round")
    parser.add_argument("--variants", default="",
                        help="comma list of name prefixes, e.g. offload,hybrid min-wait (also matches "
                             "'hybrid min-wait tuned'); '=NAME' matches NAME exactly")
    parser.add_argument("--extra-fractions", default="",
                        help="comma list: also 'hybrid min-wait f=F' rows with these fetch fractions")
    parser.add_argument("--freq-weights", default="",
                        help="comma-separated eviction weights W: every variant runs once with each (0: the contract's "
                             "LRU; W > 0: the frequency-weighted key, docs/OFFLOAD.md); default: the knob "
                             "FREETOKEN_EVICTION_FREQ_WEIGHT's, one row per variant")
    parser.add_argument("--freq-half-life", type=int, default=None,
                        help="layer calls between halvings of the route counts, for every variant whose weight is "
                             "above 0 (0: never; default: FREETOKEN_EVICTION_FREQ_HALF_LIFE)")
    parser.add_argument("--prefetch-budgets", default="",
                        help="comma list: every variant also with the lookahead prefetch on at these budgets, or auto (docs/"
                             "PREFETCH.md; a trace's recorded candidates stand in for the predictor with trace:FILE)")
    parser.add_argument("--no-resident", action="store_true", help="skip the resident run (no token check)")
    parser.add_argument("--handoff-calls", type=int, default=10_000)
    parser.add_argument("--routing", default="zipf:1.0",
                        help="'model', 'zipf[:SKEW]' or 'trace:FILE' (see bench_engine.py --routing): random-weight "
                             "presets route every token alike unless the table decides")
    parser.add_argument("--profile", type=int, default=0,
                        help="after each variant's runs, profile this many decode steps (bench_engine.profile_decode)")
    parser.add_argument("--trace-dir", default=None,
                        help="with --profile: each variant's Chrome trace (trace_<variant>.json) goes here, for "
                             "bench/trace_summary.py")
    parser.add_argument("--json-out", default=None, help="write every row as JSON here (default: $OUT/bench_hybrid.json)")
    parser.add_argument("--prefix-cache", choices=("on", "off"), default="off",
                        help="the engines' prefix cache (default off: every run prefills the whole prompt, so each "
                             "starts its decode from the same state, as before the prefix cache existed; on: the "
                             "runs after the warm-up find the prompt cached and prefill only its last block)")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    rows = []

    t0 = time.perf_counter()
    source = open_model_source(None, args.preset, dtype=args.dtype, device=device, expert_format=args.expert_format)
    spec0 = spec_from_args(argparse.Namespace(), preset=args.preset, device=args.device, dtype=args.dtype,
                           expert_format=args.expert_format, max_running_requests=1,
                           max_context_tokens=args.prompt_tokens + args.decode_tokens + 16, routing=args.routing,
                           moe_cache_size=args.cache, moe_prefetch="off", prefix_cache=args.prefix_cache)
    cfg = source.cfg
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    reference_tokens = None
    built = None
    if not args.no_resident:
        built = build_engine(spec0, source=source)
        print(f"loaded {args.preset} resident in {time.perf_counter() - t0:.1f} s", flush=True)
        res = measure(built.engine, prompt, args, None, device)
        rows.append(("resident", res))
        reference_tokens = res["tokens"]
        print("resident", res["all_tok_s"], flush=True)
        built.release_experts()          # the resident experts' GPU memory, before the host store is filled
    layout = source.experts.layout
    host = HostExperts.create_filled(source.experts, staging_device=device if device.type == "cuda" else None)
    print(f"host store {host.nbytes / 1e9:.1f} GB (pinned: {host.pinned})", flush=True)

    options = HybridOptions()
    pcie = copy_bandwidth(host.store, device, BW_CALLS)
    worker_flags = cpu_worker_flags(threads=args.cpu_threads, extra=("--log-level", "WARNING"))
    cpu = cpu_pool_bandwidth(host.store, top_k=cfg.top_k, calls=BW_CALLS, num_workers=args.cpu_workers,
                             worker_flags=worker_flags)
    fraction = args.fetch_fraction if args.fetch_fraction is not None else pcie.gb_s / (pcie.gb_s + cpu.gb_s)
    print(f"B_pcie {pcie.gb_s:.1f} GB/s, B_cpu {cpu.gb_s:.1f} GB/s -> f {fraction:.3f}", flush=True)
    try:
        shared = shared_bandwidth(host.store, device, top_k=cfg.top_k, calls=BW_CALLS, num_workers=args.cpu_workers,
                                  worker_flags=worker_flags)
        print(f"at the same time: {shared_summary(shared)}", flush=True)
    except RuntimeError as exc:                        # the rows still run; their shared columns stay empty
        print(f"the shared probe failed, no shared roofline: {exc}", flush=True)
        shared = None
    expert_bytes = layout.expert_nbytes
    both = (pcie.gb_s + cpu.gb_s) * 1e9                # the roofline's bandwidth, bytes a second
    both_shared = shared.combined_gb_s * 1e9 if shared else float("nan")    # the bytes both moved together a second
    resources = ExpertResources.over_store(host.store, "hybrid", top_k=cfg.top_k, model_dtype=host.layout.dtype,
                                           cpu=CpuWorkerSettings(num_workers=args.cpu_workers, threads=args.cpu_threads,
                                                                 log_level="WARNING"))
    resources.start_cpu_workers()
    pool = attach_cpu_pool(host.store, resources.channel_names, options, worker_info=resources.worker_info)
    slots = resolve_cache_slots(args.cache, source.experts.num_layers, source.experts.num_experts)
    try:
        handoff = handoff_round_trip(pool, cfg.hidden_size, source.dtype, device, args.handoff_calls)
        print(f"hand-off round trip: p50 {handoff['p50_us']:.1f} us, p99 {handoff['p99_us']:.1f} us", flush=True)
        pdl_modes = ("off", "on") if args.pdl == "both" else (args.pdl,)
        listed = [(n + (f" pdl {m}" if len(pdl_modes) > 1 else ""), p, m)
                  for n, p in variants(args) for m in pdl_modes]
        by_variant: dict[str, list[dict]] = {}
        for round_index, (base, policy, pdl_mode) in [(k, v) for k in range(args.rounds) for v in listed]:
            name = base + (f" round {round_index + 1}" if args.rounds > 1 else "")
            spec, hybrid, tune, budget = row_spec(spec0, policy, args, fraction, shared, pdl_mode)
            # the last row's backend closed first; the store and the pool are borrowed (closed below)
            if built is None:
                built = build_engine(spec, source=source, attachment=Attachment(host=host, pool=pool), hybrid=hybrid,
                                     pin_driving_process=False)
            else:
                built = build_engine(spec, attachment=Attachment(host=host, pool=pool), hybrid=hybrid,
                                     reuse=built, pin_driving_process=False)
            engine, backend = built.engine, built.experts
            tick = live_tuner(engine, backend, fraction, pcie.gb_s, cpu.gb_s, device_name(device),
                              fraction_given=args.fetch_fraction is not None) if tune else None
            r = measure(engine, prompt, args, backend, device, tick)
            r["cache"] = spec.moe_cache_size
            if args.profile and device.type == "cuda":
                from bench_engine import _trace_path, profile_decode   # bench/ is sys.path[0]
                profile_decode(engine, [prompt], args.profile, trace=_trace_path(args, name))
            if isinstance(backend, HybridExperts):
                r["fetch_fraction"] = float(backend.policy["fetch_fraction"])      # the tuner's last f
            r["prefetch"] = backend.prefetch_counters() if budget else None
            if budget == "auto":
                r["prefetch_auto"] = backend.slot_pool.lookahead.report()
            del engine
            r["same_tokens"] = None if reference_tokens is None else r["tokens"] == reference_tokens
            r["first_diff"] = None if reference_tokens is None else next(
                (i for i, (a, b) in enumerate(zip(r["tokens"], reference_tokens)) if a != b), None)
            rows.append((name, r))
            by_variant.setdefault(base, []).append(r)
            print("row:", table_row(name, r, both, both_shared, expert_bytes), r["all_tok_s"], flush=True)
            del backend
        if args.rounds > 1:
            rows += median_rounds(by_variant)
    finally:
        if built is not None:
            built.close()                # the last backend (its doorbells; not the store, not the pool)
        pool.close()
        resources.close()                  # the CPU workers stopped, their channels unlinked
        host.close()

    gpu = device_name(device)
    cpu_slots = (f"; cpu rows {args.cpu_cache} ("
                 f"{resolve_cache_slots(args.cpu_cache, source.experts.num_layers, source.experts.num_experts)} slots)"
                 if args.cpu_cache else "")
    print(f"\n{args.preset} {layout.dtype}, {gpu}, batch 1, cache {args.cache} ({slots} slots){cpu_slots}, prompt "
          f"{args.prompt_tokens}, {args.decode_tokens} decode tokens, routing {args.routing}, median of "
          f"{args.runs} runs; expert "
          f"{expert_bytes / 1e6:.2f} MB; B_pcie {pcie.gb_s:.1f} GB/s, B_cpu {cpu.gb_s:.1f} GB/s "
          f"({args.cpu_workers} worker(s)); at the same time: {shared_summary(shared)}; hybrid f {fraction:.3f}")
    print(f"hand-off GPU -> CPU process -> GPU: p50 {handoff['p50_us']:.1f} us, p99 {handoff['p99_us']:.1f} us, "
          f"max {handoff['max_us']:.0f} us over {handoff['calls']} calls")
    print(TABLE_HEADER)
    for name, r in rows:
        print(table_row(name, r, both, both_shared, expert_bytes))
    out_path = args.json_out or os.path.join(os.environ.get("OUT", "."), "bench_hybrid.json")
    with open(out_path, "w") as fh:
        json.dump({"preset": args.preset, "gpu": gpu, "pcie_gb_s": pcie.gb_s, "cpu_gb_s": cpu.gb_s,
                   **(shared.fields() if shared else {}),
                   "fetch_fraction": fraction, "handoff": handoff, "expert_bytes": expert_bytes,
                   "rows": [{"backend": n, **{k: v for k, v in r.items() if k != "tokens"}} for n, r in rows]},
                  fh, indent=1)
    print(f"rows written to {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
