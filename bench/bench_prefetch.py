"""Decode tok/s of the offload backend with the lookahead prefetch off, auto, on (fixed budgets) or measure,
interleaved A/B (GPU).

    python bench/bench_prefetch.py --routing trace:src/ftexpert/workload/data/qwen3-30b-a3b-routing.trace \\
        --fractions 0.25,0.5 --batch 1,4 --prefetch off,auto,on --prefetch-budget 2,4,8

A random-weight preset has no real router, so with `--routing trace:FILE` the trace's recorded predictor candidates
(its trained model's layer-L router on layer L-1's input) stand in for the live predictor (TracePredictor); with
zipf:SKEW the live router predicts a table it knows nothing of (a lower bound). Per cache fraction and batch one
offload backend; every run resets its slots and sets the configuration (SetPolicy's prefetch fields), so the
configurations alternate run by run (A, B, C, A, B, C, ...) and share the machine's drift. Reported per
configuration (medians over --runs): decode tok/s (without the host time of any decode graph captured inside a
measured run: auto's graphs are keyed by whether it predicts and by the probe's timed steps, so a state first met
there is captured there, once; the "graphs:" line gives their count, time and the figure with them), demand misses per token, useful predictions per layer, precision,
the share of would-be demand misses covered (useful / (useful + misses)), the peak GPU memory against prefetch off,
and whether the tokens equal prefetch off's (seeded sampling: the same tokens when lossless). `auto` and `measure`
rows also give what the auto rule saw at the end of their last run ("auto:" lines): the mean idle window a layer and
the count it allowed, the link bandwidth it measured, whether it would predict, the guard's decision from the
measured step times (prefetch_guard.py), the expected time it saves a step, and
(measure) the share of demand misses its choice would have covered. With CUDA graphs, "steps:" lines split each
configuration's step into the GPU's time inside the decode graph and its idle time between graphs (the host's work
between steps), medians and means (a cost of one step in N moves the mean only).
Every engine is built by `build_engine(spec)`: per cache fraction and batch one offload backend over the one host
store (`Attachment(host=...)`, `reuse=` of the last one's dense weights), and an engine a configuration over it
(`fresh_engine`: each captures its own decode graphs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench.bench_engine as be  # noqa: E402
from ftexpert.gpu_worker.api import Attachment, build_engine, open_model_source  # noqa: E402
from ftexpert.gpu_worker.backends.offload import HostExperts  # noqa: E402
from ftexpert.proto.engine_spec import spec_from_args  # noqa: E402
from ftexpert.proto.knobs import EXPERT_FORMAT_CHOICES  # noqa: E402


def _configs(args) -> list[tuple[str, int]]:
    out = []
    for mode in [m.strip() for m in args.prefetch.split(",") if m.strip()]:
        if mode not in ("off", "auto", "measure", "on"):
            raise SystemExit(f"--prefetch {mode!r}: give off, auto, measure, on (comma-separated)")
        budgets = [int(b) for b in args.prefetch_budget.split(",") if b.strip()] if mode not in ("off", "auto") else [0]
        out += [(mode, b) for b in budgets]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--expert-format", default="auto", choices=EXPERT_FORMAT_CHOICES,
                        help="the experts' format (auto: the preset's, bf16 for qwen3-30b-a3b)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--routing", default="trace:src/ftexpert/workload/data/qwen3-30b-a3b-routing.trace")
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--prefetch", default="off,on")
    parser.add_argument("--prefetch-budget", default="4", help="budgets of the on/measure runs, comma-separated")
    parser.add_argument("--prefetch-k", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--warmup-tokens", type=int, default=32,
                        help="decode tokens of each configuration's warm-up run (graph capture; auto's first samples)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--graphs", choices=("on", "off"), default="on")
    parser.add_argument("--record-probe", default=None, metavar="FILE",
                        help="write every link-probe sample the auto and measure runs read (windows, join waits, "
                             "copies, per-rank counts: prefetch.sample_record) to this JSON file, per configuration")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each cache fraction's runs, the GPU kernels of N decode steps of each "
                             "configuration (torch profiler), to see what a configuration adds to a step")
    args = parser.parse_args()
    be.engine_temperature = args.temperature
    configs = _configs(args)
    auto_lines: list[str] = []
    recorded: dict = {}
    expert_bytes = 0
    model_source = open_model_source(None, args.preset, device=args.device, expert_format=args.expert_format)
    cfg = model_source.cfg
    source = model_source.experts
    host = HostExperts.create_filled(source, staging_device=args.device if args.device == "cuda" else None)
    # the prefetch off at build (each run sets its configuration live); its predictor of --prefetch-k candidates:
    # the replayed trace's recorded ones with trace:FILE (TracePredictor), else the model's routers
    spec0 = spec_from_args(argparse.Namespace(), preset=args.preset, device=args.device,
                           expert_format=args.expert_format, moe_strategy="offload", routing=args.routing,
                           cuda_graphs=args.graphs, moe_prefetch="off", moe_prefetch_k=args.prefetch_k)
    built = None
    gen = torch.Generator().manual_seed(0)
    print(f"| routing {args.routing}, {args.preset} {source.layout.fmt.label}, {args.decode_tokens} tokens "
          f"after {args.prompt_tokens}, median of {args.runs} interleaved runs |")
    print("| cache | batch | prefetch | budget | decode tok/s | vs off | misses/token | useful/layer | precision | "
          "covered | peak GPU MiB vs off | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for batch in [int(b) for b in args.batch.split(",") if b.strip()]:
            lengths = [args.prompt_tokens + i * (args.decode_tokens + 8) for i in range(batch)]
            base = torch.randint(0, cfg.vocab_size, (lengths[-1],), generator=gen).tolist()
            prompts = [base[:n] for n in lengths]
            for frac in [float(f) for f in args.fractions.split(",") if f.strip()]:
                spec = dataclasses.replace(spec0, max_running_requests=batch, moe_cache_size=repr(frac),
                                           max_context_tokens=lengths[-1] + args.decode_tokens + 16)
                # the last backend closed first (the store is borrowed, closed below)
                built = (build_engine(spec, source=model_source, attachment=Attachment(host=host)) if built is None else
                         build_engine(spec, attachment=Attachment(host=host), reuse=built))
                backend = built.experts
                expert_bytes = backend.lookahead.expert_bytes
                engines = {c: built.fresh_engine() for c in configs}
                results: dict = {c: [] for c in configs}
                for run in range(args.runs + 1):                    # run 0: warm-up (graph capture) of each
                    for c in configs:
                        mode, budget = c
                        backend.set_policy(prefetch=mode, prefetch_budget=budget or None)
                        backend.reset_slots()
                        be._reset_peak()
                        before = backend.prefetch_counters()
                        captures = _captures(engines[c])
                        recording = args.record_probe and run and mode in ("auto", "measure")
                        backend.lookahead.recording = [] if recording else None
                        r = be.decode_run(engines[c], prompts, args.decode_tokens if run else args.warmup_tokens,
                                          backend)
                        after = backend.prefetch_counters()
                        r.update({k: after[k] - before[k] for k in after}, peak=be._peak(),
                                 auto=backend.lookahead.report(), captures=_captures(engines[c]) - captures)
                        if run:
                            results[c].append(r)
                        if backend.lookahead.recording:
                            recorded.setdefault(f"{source.layout.fmt.label}-{mode}{budget or ''}-{frac:g}-b{batch}",
                                                []).extend(backend.lookahead.recording)
                        backend.lookahead.recording = None
                off = results.get(("off", 0))
                for c in configs:
                    rs = results[c]
                    tok_s = statistics.median(_steady(r) for r in rs)
                    useful = sum(r["prefetch_useful_total"] for r in rs)
                    predicted = sum(r["prefetch_predicted_total"] for r in rs)
                    layers = sum(r["prefetch_layer_calls_total"] for r in rs)
                    misses = statistics.median(r["misses_per_token"] for r in rs)
                    n_tokens = sum(sum(len(t) for t in r["tokens"]) for r in rs)
                    miss_total = misses * n_tokens
                    off_tok_s = statistics.median(_steady(r) for r in off) if off else None
                    peak = (max(r["peak"] for r in rs) - max(r["peak"] for r in off)) / 2**20 if off else 0.0
                    lossless = all(r["tokens"] == o["tokens"] for r, o in zip(rs, off)) if off else "-"
                    print(f"| {frac:.0%} | {batch} | {c[0]} | {c[1] or '-'} | {tok_s:.1f} | "
                          f"{(tok_s / off_tok_s - 1) * 100:+.1f}% | {misses:.2f} | "
                          f"{useful / layers if layers else 0:.2f} | {useful / predicted if predicted else 0:.2f} | "
                          f"{useful / (useful + miss_total) if useful + miss_total else 0:.0%} | {peak:+.1f} | "
                          f"{lossless} |" if off_tok_s else f"| {frac:.0%} | {batch} | {c} | {tok_s:.1f} |",
                          flush=True)
                for c in configs:
                    if c[0] in ("auto", "measure"):
                        auto_lines.append(auto_line(frac, batch, c, results[c]))
                    if all("graph_ms" in r for r in results[c]):   # where a step's time goes: in the graph or between
                        print(steps_line(frac, batch, c, results[c]), flush=True)
                    captured = sum(r["captures"] for r in results[c])
                    if captured:      # a capture inside a timed run: the table's tok/s leaves its host time out
                        took = sum(r.get("capture_s", 0.0) for r in results[c])
                        raw = statistics.median(r["decode_tok_s"] for r in results[c])
                        print(f"graphs: {frac:.0%} batch {batch} {c[0]} {c[1] or ''}: {captured} decode graph(s) "
                              f"captured inside the measured runs, {took * 1e3:.0f} ms; the table's tok/s leaves "
                              f"that out (with it: {raw:.1f})", flush=True)
                if args.profile and args.device == "cuda":
                    for c in configs:
                        backend.set_policy(prefetch=c[0], prefetch_budget=c[1] or None)
                        backend.reset_slots()
                        print(f"profile: {frac:.0%} batch {batch} prefetch {c[0]} {c[1] or ''}", flush=True)
                        be.profile_decode(engines[c], prompts, args.profile)
                del engines, backend
    finally:
        if built is not None:
            built.close()
        host.close()
    for line in auto_lines:
        print(line)
    if args.record_probe:
        with open(args.record_probe, "w") as f:
            json.dump({"about": "link-probe samples of bench_prefetch.py's measured runs (prefetch.sample_record), "
                                f"{args.preset}, routing {args.routing}, {args.decode_tokens} decode tokens a run",
                       "layers": cfg.num_layers, "k": args.prefetch_k, "expert_bytes": expert_bytes,
                       "scenarios": {name: {"samples": s} for name, s in recorded.items()}}, f)
        print(f"probe samples: {sum(len(s) for s in recorded.values())} written to {args.record_probe}")
    return 0


def _steady(run: dict) -> float:
    """A run's decode tok/s without the host time of graphs captured inside it (a capture is once per backend
    state an engine meets, not a cost of each step)."""
    return run.get("decode_tok_s_without_captures", run["decode_tok_s"])


def _captures(engine) -> int:
    """Decode graphs the engine captured so far (0 without graphs)."""
    return engine.graphs.captures if engine.graphs is not None else 0


def guard_text(guard: dict | None) -> str:
    """The guard's state (prefetch_guard.py): its decision from the measured step times and the median ratio."""
    if not guard or guard["ratio"] is None:
        return " (guard: no step compared)"
    state = {None: "exploring", True: "on", False: "off"}[guard["decided_on"]]
    return f" (guard: {state}, steps on / off {guard['ratio']:.3f} over {guard['ratios']} block pairs)"


def steps_line(frac: float, batch: int, config: tuple[str, int], rs: list[dict]) -> str:
    """A configuration's decode step split into the GPU's time inside the graph and between graphs (decode_run's
    per-run medians and means), the median over its runs."""
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rs)
    return (f"steps: {frac:.0%} batch {batch} {config[0]} {config[1] or ''}: GPU in the graph {med('graph_ms'):.3f} ms "
            f"(mean {med('graph_mean_ms'):.3f}), between graphs {med('between_ms'):.3f} ms (mean "
            f"{med('between_mean_ms'):.3f}), medians of the runs")


def auto_line(frac: float, batch: int, config: tuple[str, int], rs: list[dict]) -> str:
    """What the auto rule saw at the end of the configuration's last run, and (measure) what its choice would have
    covered over the runs: auto_useful / (auto_useful + demand misses)."""
    rep = rs[-1]["auto"]
    windows = [w for w in rep["windows_s"][1:]]
    allowed = rep["allowed"][1:]
    useful = sum(r["prefetch_auto_useful_total"] for r in rs)
    chosen = sum(r["prefetch_auto_predicted_total"] for r in rs)
    n_tokens = sum(sum(len(t) for t in r["tokens"]) for r in rs)
    misses = sum(r["misses_per_token"] * sum(len(t) for t in r["tokens"]) for r in rs)
    covered = useful / (useful + misses) if useful + misses else 0.0
    return (f"auto: {frac:.0%} batch {batch} {config[0]}{'' if config[0] == 'auto' else f' {config[1]}'}: window "
            f"{1e6 * sum(windows) / max(len(windows), 1):.1f} us a layer (mean), allowed "
            f"{sum(allowed) / max(len(allowed), 1):.2f} a layer (max {max(allowed, default=0)}), link "
            f"{rep['bandwidth'] / 1e9:.1f} GB/s, predicting {rep['active']}{guard_text(rep.get('guard'))}, expected gain "
            f"{1e3 * rep['gain_s_per_step']:.3f} ms a step; its choice: {chosen / max(n_tokens, 1):.2f} a token, "
            f"precision {useful / chosen if chosen else 0:.2f}, covers {covered:.0%} of the demand misses")


if __name__ == "__main__":
    raise SystemExit(main())
