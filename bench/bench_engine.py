"""Decode benchmark of the engine on a real model's shape (resident and offload), on one GPU.

qwen3-30b-a3b preset (seeded random weights, bf16), batch 1 (or --batch B requests together), a 1K-token
prompt, N decode tokens, median of R runs after a warm-up. Offload runs share one host expert store; greedy tokens of every
offload run are checked against the resident run's. Prints a table last.
Every engine is built by `build_engine(spec)` (gpu_worker/assembly/build.py): the resident rows are engines over one
model (`fresh_engine(spec)`: graphs, overlap, dense projections, PDL, routing), the offload rows backends over its
dense weights and the one host store (`build_engine(spec, attachment=Attachment(host=...), reuse=...)`), with the
lookahead prefetch off (bench_prefetch.py measures it).
Usage: python bench/bench_engine.py [--runs 5] [--decode-tokens 256] [--fractions 0.1,0.25,0.5]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ftexpert.gpu_worker.api import Attachment, Engine, SamplingParams, build_engine  # noqa: E402
from ftexpert.gpu_worker.models.model import MoeModel  # noqa: E402
from ftexpert.proto.engine_spec import EXPERT_COMPUTE_MODES, routing_flag, spec_from_args  # noqa: E402
from ftexpert.proto.knobs import EXPERT_FORMAT_CHOICES, positive_int_flag  # noqa: E402
from ftexpert.gpu_worker.backends.offload import HostExperts, resolve_cache_slots  # noqa: E402
import ftexpert.kernels.expert_copy.api as expert_copy_api  # noqa: E402
try:                                  # run as bench/bench_engine.py (bench/ on sys.path) or imported as bench.bench_engine
    from kernel_table import family_table, gpu_kernel_table, kernel_rows  # noqa: E402
    from hbm_roofline import (describe as describe_hbm, hbm_bandwidth,  # noqa: E402
                              routed_experts_per_layer, step_bytes)
except ImportError:
    from bench.kernel_table import family_table, gpu_kernel_table, kernel_rows  # noqa: E402
    from bench.hbm_roofline import (describe as describe_hbm, hbm_bandwidth,  # noqa: E402
                                    routed_experts_per_layer, step_bytes)


def _copy_chunks(args) -> list[int]:
    return [int(c) for c in args.copy_chunks.split(",") if c.strip()] or [expert_copy_api.DEFAULT_CHUNKS]


def _timed_copies(dst: torch.Tensor, sources: list[torch.Tensor]) -> float:
    """Seconds the GPU took for `dst.copy_(src)` of every source back to back, between two CUDA events."""
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for src in sources:
        dst.copy_(src, non_blocking=True)
    e.record()
    e.synchronize()
    return a.elapsed_time(e) / 1e3


def pcie_bandwidth(expert_bytes: int, reps: int = 50) -> float:
    """Host (pinned) -> GPU bandwidth for expert-sized copies, bytes/s (median of reps)."""
    src = torch.empty(expert_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(expert_bytes, dtype=torch.uint8, device="cuda")
    times = [_timed_copies(dst, [src]) for _ in range(reps + 5)]
    return expert_bytes / statistics.median(times[5:])


def pcie_store_bandwidth(host: HostExperts, batch: int = 16, batches: int = 8, seed: int = 0) -> tuple[float, float]:
    """Host -> GPU bandwidth for DMA copies of distinct experts of the pinned store itself, in a seeded random
    (layer, expert) order, bytes/s: (sustained, single). Sustained: `batch` copies back to back on one stream
    between two events (the link kept busy, no launch gap between copies), median over `batches` batches;
    the roofline's figure. Single: each copy timed alone (it includes one launch and completion latency a
    copy), median. Unlike `pcie_bandwidth`, which copies one buffer again and again, every copy here reads
    bytes not read before in this probe, from host DRAM, as a decode step's misses do."""
    if not host.pinned:
        print("bench_engine: the host store is not pinned: its copies are staged through pageable memory, "
              "and the PCIe figures below are not the link's", flush=True)
    gen = torch.Generator().manual_seed(seed)
    total = host.num_layers * host.num_experts
    order = torch.randperm(total, generator=gen).tolist()
    rows = [host.layers[f // host.num_experts][f % host.num_experts] for f in order[:(batches + 5) * batch]]
    dst = torch.empty_like(rows[0], device="cuda")
    nbytes = dst.numel() * dst.element_size()
    sustained = [_timed_copies(dst, rows[b * batch:(b + 1) * batch]) / batch
                 for b in range(batches + 1)][1:]                      # batch 0: warm-up
    single = [_timed_copies(dst, [row]) for row in rows[(batches + 1) * batch:]][4:]
    return nbytes / statistics.median(sustained), nbytes / statistics.median(single)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


engine_temperature = 1.0


def decode_run(engine: Engine, prompts: list[list[int]], num_tokens: int, backend) -> dict:
    """One request per prompt, run together (continuous batching): prefill until every request has its first
    token, then decode; counters of the decode phase only. tok/s counts every request's tokens."""
    tokens: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=num_tokens, ignore_eos=True,
                                temperature=engine_temperature, seed=1234 + i)
        tokens[engine.add_request(prompt, params, request_id=i)] = []
    while not all(tokens.values()):                      # prefill (chunks) up to every request's first token
        for out in engine.step():
            tokens[out.request_id].append(out.new_token_id)
    before = None
    if backend is not None:
        st = backend.refresh_stats()
        before = (st.distinct_misses, st.fetched, st.copy_bytes, backend.collect_copy_time())
    _sync()
    graphs = engine.graphs
    launch0 = (graphs.replay_host_s, graphs.replays) if graphs is not None else (0.0, 0)
    capture0 = (graphs.captures, graphs.capture_s) if graphs is not None else (0, 0.0)
    first = sum(len(t) for t in tokens.values())
    marks: list[tuple] = []                 # CUDA events around each graph replay: the GPU's share of a step
    if graphs is not None and torch.cuda.is_available():
        plain_run = graphs.run

        def timed_run(inputs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = plain_run(inputs)
            b.record()
            marks.append((a, b))
            return out
        graphs.run = timed_run
    t0 = time.perf_counter()
    try:
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id].append(out.new_token_id)
        _sync()
    finally:
        if graphs is not None:
            graphs.__dict__.pop("run", None)
    elapsed = time.perf_counter() - t0
    n = sum(len(t) for t in tokens.values()) - first           # tokens decoded in the timed phase
    result = {"tokens": [tokens[i] for i in range(len(prompts))], "decode_tok_s": n / elapsed}
    if graphs is not None and graphs.captures > capture0[0]:
        # graphs captured inside the timed phase (a backend state first seen there): their host time, and the
        # speed without it (what the run decodes at once every graph it needs exists)
        capture_s = graphs.capture_s - capture0[1]
        result.update(captures=graphs.captures - capture0[0], capture_s=capture_s,
                      decode_tok_s_without_captures=n / max(elapsed - capture_s, 1e-9))
    if graphs is not None and graphs.replays > launch0[1]:
        result["launch_us"] = 1e6 * (graphs.replay_host_s - launch0[0]) / (graphs.replays - launch0[1])
    if len(marks) > 2:
        # median ms from a replay's start to its end (the graph), and from one replay's end to the next one's start
        # (the engine's host work between steps, sampling included, while the GPU has no graph to run)
        inside = [a.elapsed_time(b) for a, b in marks]
        between = [b.elapsed_time(a2) for (_, b), (a2, _) in zip(marks, marks[1:])]
        result["graph_ms"], result["between_ms"] = statistics.median(inside), statistics.median(between)
        # the means as well: a cost paid in one step in N (a probe's timed step) moves them, not the medians
        result["graph_mean_ms"], result["between_mean_ms"] = statistics.fmean(inside), statistics.fmean(between)
    if backend is not None:
        st = backend.refresh_stats()
        misses, fetched, nbytes, copy_s = (a - b for a, b in zip(
            (st.distinct_misses, st.fetched, st.copy_bytes, backend.collect_copy_time()), before))
        result.update(misses_per_token=misses / n, fetched_per_token=fetched / n,
                      copy_gb_s=nbytes / copy_s / 1e9 if copy_s else 0.0)
    return result


def measure(engine, prompts, args, backend=None) -> dict:
    decode_run(engine, prompts, min(args.decode_tokens, 32), backend)          # warm-up
    runs = [decode_run(engine, prompts, args.decode_tokens, backend) for _ in range(args.runs)]
    best = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]       # the median run
    best["all_tok_s"] = [round(r["decode_tok_s"], 2) for r in runs]
    # the tokens compared across configurations: every configuration's first measured run (the median run is another
    # run in each); whether this engine's own runs gave the same tokens is the table's "*" (lossless_cell)
    best["first_tokens"] = runs[0]["tokens"]
    best["runs_agree"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    return best


def first_diff(tokens: list[list[int]], reference: list[list[int]]) -> int | None:
    """The first decode position (0: the token sampled from the prefill's logits) at which any request's tokens
    differ from the reference's (a shorter list differs where it ends); None where all are equal."""
    if len(tokens) != len(reference):
        return 0
    found = []
    for got, ref in zip(tokens, reference):
        i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if i is None and len(got) != len(ref):
            i = min(len(got), len(ref))
        if i is not None:
            found.append(i)
    return min(found) if found else None


def compare_to(r: dict, reference: list[list[int]]) -> None:
    """r's lossless (its first run's tokens equal the reference's) and, where not, the first differing position."""
    r["first_diff"] = first_diff(r["first_tokens"], reference)
    r["lossless"] = r["first_diff"] is None


def lossless_cell(r: dict) -> str:
    """The table's lossless cell: the first run's tokens equal the reference's (True / False@N, N the first decode
    position that differs: 0 is the token sampled from the prefill's logits), '-' for the reference itself; a '*'
    where the configuration's own runs disagreed with each other."""
    cell = str(r.get("lossless", "-"))
    if r.get("lossless") is False and r.get("first_diff") is not None:
        cell += f"@{r['first_diff']}"
    return cell + ("" if r.get("runs_agree", True) else "*")


def _profiled_steps(engine: Engine, prompts: list[list[int]], steps: int, profiler) -> None:
    """The prompts' requests together: prefill and a few steps outside, then `steps` decode steps inside the context
    manager `profiler`, then the rest of the requests."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True,
                                                  temperature=engine_temperature, seed=1234 + i))
    for _ in range(3 + len(prompts)):                   # prefill and a few steps outside
        engine.step()
    _sync()
    with profiler:
        for _ in range(steps):
            engine.step()
        _sync()
    while engine.has_work():
        engine.step()


def profile_decode(engine: Engine, prompts: list[list[int]], steps: int, top: int = 25,
                   trace: str | None = None, hbm: tuple[dict, float] | None = None) -> None:
    """Print the `top` GPU kernels by total time over `steps` decode steps of the prompts' requests together
    (torch.profiler); with `trace`, also write the Chrome trace (every kernel with its stream, start and
    duration) to that path; with `hbm` (step_bytes' parts, the measured HBM bytes/s), the rate each kernel family
    reads its bytes at (kernel_table.family_table)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    _profiled_steps(engine, prompts, steps, prof)
    if trace:
        prof.export_chrome_trace(trace)
        print(f"profile: trace written to {trace}")
    for line in gpu_kernel_table(prof, steps, "step", top):
        print(line)
    if hbm is not None:
        head = engine.model.dense.lm_head
        for line in family_table(kernel_rows(prof, steps), hbm[0], head.numel() * head.element_size(), hbm[1]):
            print(line)


def host_profile_decode(engine: Engine, prompts: list[list[int]], steps: int, top: int = 22) -> None:
    """cProfile over `steps` decode steps (after prefill): the host functions by own time, to find the host work
    between two graph replays (the time the GPU has no graph to run). Waits for the GPU show as the sync calls."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    _profiled_steps(engine, prompts, steps, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"host profile, {steps} decode steps (tottime first):")
    print("\n".join(line[:160] for line in buf.getvalue().splitlines() if line.strip())[-6000:], flush=True)


def _launch_note(res: dict) -> str:
    """Host time a decode step spends inside the CUDA graph launch (cudaGraphLaunch), beside the step time."""
    if "launch_us" not in res:
        return ""
    gpu = (f"; GPU: graph {res['graph_ms']:.3f} ms, between graphs {res['between_ms']:.3f} ms (medians)"
           if "graph_ms" in res else "")
    return f"(graph launch {res['launch_us']:.0f} us of a {1e6 / res['decode_tok_s']:.0f} us step, host time{gpu})"


def _trace_path(args, name: str) -> str | None:
    if not args.trace_dir:
        return None
    os.makedirs(args.trace_dir, exist_ok=True)
    return os.path.join(args.trace_dir, "trace_" + re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_") + ".json")


def _table(args, source, rows, bw, bw_hot=None, bw_single=None, hbm=None) -> int:
    expert_bytes = source.layout.expert_nbytes
    total_expert_bytes = source.num_layers * source.num_experts * expert_bytes
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{args.preset} {source.layout.dtype} {source.layout.fmt.label} experts, {device}, torch {torch.__version__}, batch {args.batch}, "
          f"prompt {args.prompt_tokens}{f' (+ {args.decode_tokens + 8} a request)' if args.batch > 1 else ''}, "
          f"{args.decode_tokens} decode tokens (temperature "
          f"{args.temperature}, seeded; routing {args.routing}), median of {args.runs} runs; expert "
          f"{expert_bytes / 1e6:.2f} MB, experts {total_expert_bytes / 1e9:.1f} GB; PCIe: DMA copies of distinct "
          f"experts of the pinned store back to back (the roofline's) {(bw or 0) / 1e9:.1f} GB/s, the same timed "
          f"one copy at a time (%single) {(bw_single or 0) / 1e9:.1f} GB/s, one pinned buffer copied again and "
          f"again (%hot) {(bw_hot or 0) / 1e9:.1f} GB/s")
    hbm_roof = float("nan")
    if hbm is not None:                  # (bytes a step, HBM bytes/s): the resident step's bound, every row beside it
        hbm_roof = args.batch * hbm[1] / hbm[0]["total"]
        print(describe_hbm(*hbm) + f": {hbm_roof:.1f} tok/s")
    print(table_header())
    for name, slots, r, peak, rss in rows:
        miss = r.get("misses_per_token")
        roof = bw / (miss * expert_bytes) if miss and bw else float("nan")
        pct = 100 * r["decode_tok_s"] / roof if miss and bw else float("nan")
        pct_hot = 100 * r["decode_tok_s"] * miss * expert_bytes / bw_hot if miss and bw_hot else float("nan")
        pct_single = 100 * r["decode_tok_s"] * miss * expert_bytes / bw_single if miss and bw_single else float("nan")
        print(table_line(name, slots, r["decode_tok_s"], hbm_roof, roof, pct, pct_single, pct_hot, miss or 0,
                         r.get("copy_gb_s", 0), lossless_cell(r), peak / 2**30, rss / total_expert_bytes))
    return 0


def table_header() -> str:
    """The last table's header (bench/peer_llamacpp/run_peer.py finds its columns by their places in it)."""
    return (f"{'backend':<20} {'slots':>5} {'tok/s':>7} {'HBM roof':>8} {'%HBM':>4} {'roofline':>8} {'%roof':>5} "
            f"{'%single':>7} {'%hot':>5} {'miss/tok':>8} {'copy GB/s':>9} {'lossless':>8} {'GPU GiB':>7} {'RSS/exp':>7}")


def table_line(name, slots, tok_s, hbm_roof, roof, pct, pct_single, pct_hot, miss, copy_gb_s, lossless, gib,
               rss_per_expert_byte) -> str:
    """A row of the last table, each cell right-aligned under its header."""
    return (f"{name:<20} {slots!s:>5} {tok_s:>7.2f} {hbm_roof:>8.1f} {100 * tok_s / hbm_roof:>4.0f} "
            f"{roof:>8.2f} {pct:>5.0f} {pct_single:>7.0f} {pct_hot:>5.0f} "
            f"{miss:>8.1f} {copy_gb_s:>9.1f} {str(lossless):>8} {gib:>7.1f} {rss_per_expert_byte:>7.2f}")


def use_tensor_core_gemvs() -> None:
    """--quant-gemv mma: the mxfp4 / nvfp4 defaults of this process with gate/up and down on the tensor cores."""
    from dataclasses import replace

    from ftexpert.kernels.moe_decode.api import QUANT_GEMV_BLOCKS
    from ftexpert.proto.expert_format import ExpertFormat
    for name, b in list(QUANT_GEMV_BLOCKS.items()):
        group = ExpertFormat.parse(name).group_size
        QUANT_GEMV_BLOCKS[name] = replace(b, quant_mma=True, quant_mma_down=True, gate_up_block_n=64,
                                          gate_up_block_k=16 * group, down_block_n=128, down_block_k=16 * group,
                                          mma_warps=8)
    print(f"quant gemv: {QUANT_GEMV_BLOCKS}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--expert-format", default="auto", choices=EXPERT_FORMAT_CHOICES,
                        help="the experts' format (auto: the preset's: bf16, mxfp4 for gpt-oss; quantized while loading otherwise)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--fractions", default="0.1,0.25,0.5")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--batch", type=int, default=1,
                        help="requests decoded together (continuous batching; the engine's max_running_requests): "
                             "request i's prompt is --prompt-tokens + i * (--decode-tokens + 8) tokens, so that no two "
                             "requests decode at the same position (the synthetic routing draws per position); "
                             "tok/s counts every request's tokens")
    parser.add_argument("--expert-compute", default="auto", choices=EXPERT_COMPUTE_MODES,
                        help="the experts' FFN on the GPU for every row (EngineSpec.expert_compute): auto takes gemv "
                             "(CUDA-graph safe) up to the backend's bound (resident 128 (token, expert) pairs, "
                             "offload / hybrid 32), grouped GEMMs above (in the graphs too for resident bf16 on "
                             "Hopper+)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="seeded sampling: varied tokens route like real text, not one loop")
    parser.add_argument("--graphs", choices=("on", "off", "both"), default="on",
                        help="CUDA graphs for resident decode (both: eager and graphs side by side)")
    parser.add_argument("--routing", default="zipf:1.0",
                        help="'model': the preset's router picks experts (random weights route nearly "
                             "every token alike: almost no misses); 'zipf[:SKEW]': seeded per-position "
                             "expert ids from a skewed popularity; 'trace:FILE': a trained model's recorded routes "
                             "(ft bench routing --trace; gpu_worker/models/synthetic_routing.py); several, "
                             "comma-separated: every run once per routing, side by side")
    parser.add_argument("--copy-chunks", default="",
                        help="comma list: run offload once per value of the copy kernel's programs per expert "
                             "(kernels.expert_copy.api.DEFAULT_CHUNKS; default: its value)")
    parser.add_argument("--copy-split", choices=("on", "off", "both"), default="on",
                        help="offload's decode copy: every planned w13, then every w2, the fetched "
                             "routes' gate/up between the two (on, the default), or each expert whole (off); "
                             "both: side by side")
    parser.add_argument("--dense-linear", default="gemv",
                        help="the fused forward's dense projections: gemv (kernels/dense_gemv), torch (F.linear), "
                             "or both comma-separated (resident runs for each; offload runs use the first)")
    parser.add_argument("--pdl", choices=("auto", "on", "off", "both"), default=None,
                        help="programmatic dependent launch of the decode kernels (FREETOKEN_PDL, kernels/pdl.py) for "
                             "every run (default: as FREETOKEN_PDL says); both: each configuration with it off, then on, side by side")
    parser.add_argument("--freq-weights", default="0",
                        help="the slot cache's eviction key, comma-separated: 0 (least recently used, the default) and "
                             "frequency weights W > 0 (FREETOKEN_EVICTION_FREQ_WEIGHT; docs/OFFLOAD.md)")
    parser.add_argument("--freq-half-life", type=int, default=None,
                        help="with --freq-weights W > 0: layer calls between halvings of the route counts (0: never; "
                             "default: FREETOKEN_EVICTION_FREQ_HALF_LIFE, 3072)")
    parser.add_argument("--kv-block-size", type=positive_int_flag, default=None,
                        help="positions per KV block (default: the engine's, 16); a block of the whole context "
                             "(e.g. 2048 here) gives each request one page, as the KV rows before paging")
    parser.add_argument("--overlap-decode", default="auto",
                        help="comma-separated auto, on, off: the engine spec's overlap_decode for every resident and offload "
                             "run (the next decode step queued before this one's tokens are read; auto: on with "
                             "CUDA); several: side by side")
    parser.add_argument("--quant-gemv", choices=("default", "mma"), default="default",
                        help="mxfp4 / nvfp4 experts' decode GEMVs: the defaults (QUANT_GEMV_BLOCKS), or both on the "
                             "tensor cores (GemvBlocks.quant_mma and quant_mma_down: gate/up 64 rows, down 128, 16 "
                             "groups a K step, 8 warps; docs/QUANTIZATION.md), for this process")
    parser.add_argument("--trace-dir", default=None,
                        help="with --profile: write each profiled run's Chrome trace (trace_<backend>.json) here")
    parser.add_argument("--host-profile", type=int, default=0,
                        help="after each resident and offload run, cProfile this many decode steps (host functions)")
    parser.add_argument("--profile", type=int, default=0,
                        help="after each resident and offload run, profile this many decode steps and print the "
                             "top GPU kernels (resident: also each kernel family's rate against the measured HBM "
                             "bandwidth, bench/kernel_table.py)")
    args = parser.parse_args()
    global engine_temperature
    engine_temperature = args.temperature
    proc = psutil.Process()
    rows = []

    t0 = time.perf_counter()
    if args.batch < 1:
        raise SystemExit(f"--batch {args.batch}: give at least 1")
    lengths = [args.prompt_tokens + i * (args.decode_tokens + 8) for i in range(args.batch)]
    specs = [spec.strip() for spec in args.routing.split(",") if spec.strip()]
    if not specs:
        raise SystemExit("--routing: give at least one of model, zipf[:SKEW], trace:FILE")
    for spec in specs:
        try:
            routing_flag(spec)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"--routing {spec!r}: {exc}") from None
    linears = [v.strip() for v in args.dense_linear.split(",") if v.strip()]
    if not linears or any(v not in MoeModel.DENSE_LINEARS for v in linears):
        raise SystemExit(f"--dense-linear {args.dense_linear!r}: give gemv, torch or both, comma-separated")
    overlaps_decode = [v.strip() for v in args.overlap_decode.split(",") if v.strip()]
    if not overlaps_decode or any(v not in ("auto", "on", "off") for v in overlaps_decode):
        raise SystemExit(f"--overlap-decode {args.overlap_decode!r}: give auto, on, off, comma-separated")
    if args.quant_gemv == "mma":
        use_tensor_core_gemvs()
    # the FREETOKEN_* knobs (PDL, eviction half-life, ...) from the environment, as the CLIs resolve them
    base = spec_from_args(argparse.Namespace(), preset=args.preset, device=args.device,
                          expert_format=args.expert_format, max_running_requests=args.batch,
                          max_context_tokens=lengths[-1] + args.decode_tokens + 16, routing=specs[0],
                          dense_linear=linears[-1], moe_prefetch="off", expert_compute=args.expert_compute,
                          kv_block_size=args.kv_block_size)
    built = build_engine(base)
    cfg = built.cfg
    base = built.spec
    gen = torch.Generator().manual_seed(0)
    base_ids = torch.randint(0, cfg.vocab_size, (lengths[-1],), generator=gen).tolist()
    prompt = [base_ids[:n] for n in lengths]              # one prompt a request (batch 1: the old single prompt)
    print(f"loaded {args.preset} resident in {time.perf_counter() - t0:.1f} s", flush=True)

    # --routing A,B: every configuration once per routing, side by side (each checked against resident's
    # tokens under the same routing)
    def routing_label(spec: str) -> str:
        if len(specs) < 2:
            return ""
        return " " + (spec.rsplit("/", 1)[-1].removesuffix(".trace") if spec.startswith("trace:") else spec)
    reference_by_routing: dict[str, list] = {}
    pdl_modes = ("off", "on") if args.pdl == "both" else (args.pdl or base.pdl,)

    def overlap_label(value) -> str:
        return "" if len(overlaps_decode) < 2 else f" overlap {value}"

    hbm = None
    if args.device == "cuda":            # the resident step's HBM roofline (bench/hbm_roofline.py)
        contexts = [n + args.decode_tokens // 2 for n in lengths]      # a request's mean context while decoding
        steps = [[n + s for n in lengths] for s in range(args.decode_tokens)]    # the decode steps' positions
        hbm = (step_bytes(built.model, built.source.experts.layout.expert_nbytes, contexts,
                          routed_experts_per_layer(built.model, steps)), hbm_bandwidth())
    for routing, linear, graphs, pdl_mode, od in [
            (rt, lin, g, p, o) for rt in specs for lin in reversed(linears)
            for g in (("off", "on") if args.graphs == "both" else (args.graphs,))
            for p in pdl_modes for o in overlaps_decode]:
        _reset_peak()
        # (the PDL setting is read when the kernels launch: this engine's graphs keep it; the last dense_linear run,
        # the first listed, stays for the offload runs)
        engine = built.fresh_engine(dataclasses.replace(base, routing=routing, dense_linear=linear, cuda_graphs=graphs,
                                                        pdl=pdl_mode, overlap_decode=od))
        res = measure(engine, prompt, args)
        reference_tokens = reference_by_routing.get(routing)
        if linear == linears[0]:               # another dense_linear rounds differently: not comparable
            if reference_tokens is not None:
                compare_to(res, reference_tokens)
            reference_by_routing.setdefault(routing, res["first_tokens"])
        name = "resident" + (" graphs" if graphs == "on" else " eager") + (f" {linear}" if len(linears) > 1 else "") \
            + (f" pdl {pdl_mode}" if len(pdl_modes) > 1 else "") + overlap_label(od) + routing_label(routing)
        rows.append((name, "-", res, _peak(), proc.memory_info().rss))
        print(name, res["all_tok_s"], _launch_note(res), flush=True)
        if args.profile and args.device == "cuda":
            profile_decode(engine, prompt, args.profile, trace=_trace_path(args, name), hbm=hbm)
        if args.host_profile:
            host_profile_decode(engine, prompt, args.host_profile)
        del engine
    source = built.source.experts
    if not args.fractions:
        return _table(args, source, rows, None, hbm=hbm)
    expert_bytes = source.layout.expert_nbytes
    built.release_experts()             # the resident experts' GPU memory, before the host store is filled
    t0 = time.perf_counter()
    host = HostExperts.create_filled(source, staging_device=args.device)
    print(f"host store {host.nbytes / 1e9:.1f} GB filled and pinned ({host.pinned}) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    bw_hot = pcie_bandwidth(expert_bytes) if args.device == "cuda" else 1e9
    bw, bw_single = pcie_store_bandwidth(host) if args.device == "cuda" else (1e9, 1e9)
    shared = Attachment(host=host)      # every offload backend over this one store (borrowed: closed here)
    try:
        for frac in [float(f) for f in args.fractions.split(",") if f]:
            splits = {"on": ["split"], "off": ["whole"], "both": ["split", "whole"]}[args.copy_split]
            weights = [int(w) for w in args.freq_weights.split(",") if w.strip()]
            modes = [(c, sp, p, w, od, rt) for rt in specs for w in weights for c in _copy_chunks(args)
                     for sp in splits for p in pdl_modes for od in overlaps_decode]
            for chunks, split, pdl_mode, weight, od, routing in modes:
                expert_copy_api.DEFAULT_CHUNKS = chunks
                label = f"c={chunks}" if args.copy_chunks else ""
                if args.copy_split == "both":
                    label += f" {split}"
                if len(pdl_modes) > 1:
                    label += f" pdl {pdl_mode}"
                if len(weights) > 1 or weight:
                    label += f" fw{weight}"
                label = (label + overlap_label(od) + routing_label(routing)).strip()
                slots = resolve_cache_slots(frac, source.num_layers, source.num_experts)
                spec = dataclasses.replace(base, moe_strategy="offload", moe_cache_size=repr(frac), expert_copy=split,
                                           eviction_freq_weight=weight, routing=routing, pdl=pdl_mode,
                                           overlap_decode=od, dense_linear=linears[0],
                                           eviction_freq_half_life=(base.eviction_freq_half_life
                                                                    if args.freq_half_life is None
                                                                    else args.freq_half_life))
                _reset_peak()
                built = build_engine(spec, attachment=shared, reuse=built)     # the last row's backend closed first
                r = measure(built.engine, prompt, args, built.experts)
                compare_to(r, reference_by_routing[routing])
                name = f"offload {frac:.0%} {label}".strip()
                rows.append((name, slots, r, _peak(), proc.memory_info().rss))
                print(name, r["all_tok_s"], _launch_note(r), flush=True)
                if args.profile and args.device == "cuda":
                    profile_decode(built.engine, prompt, args.profile, trace=_trace_path(args, name))
                if args.host_profile:
                    host_profile_decode(built.engine, prompt, args.host_profile)
    finally:
        built.close()
        host.close()

    return _table(args, source, rows, bw, bw_hot, bw_single, hbm=hbm)


if __name__ == "__main__":
    raise SystemExit(main())
