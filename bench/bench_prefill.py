"""Prefill benchmark of the engine (time to first token), resident and offload, on one GPU.

A prefill chunk routes to nearly every expert of every layer (a 512-token chunk makes 4,096 routes over
128 experts a layer), so in `offload` a chunk is bound by copying what the slot cache lacks: about one
pass over all experts a chunk. This measures, for one prompt and greedy sampling:

- TTFT: from `add_request` to the first token (median of R runs after a warm-up), and prompt tokens / s;
- the experts copied during the prefill and the roofline `copied * expert_bytes / PCIe_bw` beside it
  (PCIe: DMA copies of distinct experts of the pinned store back to back, as in bench_engine.py);
- offload's prefill copy path: a plan readback, then one DMA per expert on the copy stream, every layer's
  call also copying the next layer's experts behind its own, so they land while this layer computes;
- the chunk size (`--chunks`): every chunk pays its pass over the experts again;
- prefill attention (`--attention`, resident rows only; the other rows take the first): `auto` (SDPA's flash
  kernel with a lower-right causal bias object, no mask in memory, where it applies) against `bias` (the folded
  additive bias, built once a forward; attention.PREFILL_KERNEL);
- whether the first token equals the resident run's (greedy: lossless; not expected of `hybrid`, whose CPU
  share is computed by another kernel);
- `hybrid`: a chunk of at most `cpu_max_tokens` (512) splits each layer's misses with the CPU pool; a longer one
  runs as offload with the prefill prefetch. Its "copied" column counts whole experts fetched; the roofline is
  shown where it ran as offload.

Every engine is built by `build_engine(spec)`: the resident rows over one model (`fresh_engine`), the offload and
hybrid rows backends over its dense weights, the one host store and (hybrid) one CPU pool (`Attachment(host=...,
pool=...)`, `reuse=`), the lookahead prefetch off.

Usage: python bench/bench_prefill.py [--runs 3] [--prompt-tokens 1024] [--chunks 512,1024]
       [--fractions 0.1,0.5] [--variants offload,hybrid]
Prints one line per run as it goes and a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]   # ftexpert, bench

from bench.bench_engine import _sync, pcie_store_bandwidth  # noqa: E402
import ftexpert.gpu_worker.engine.attention as attention  # noqa: E402
from ftexpert.gpu_worker.api import (Attachment, Engine, HybridOptions, SamplingParams, attach_cpu_pool,  # noqa: E402
                                     build_engine)
from ftexpert.proto.engine_spec import spec_from_args  # noqa: E402
from ftexpert.proto.knobs import EXPERT_FORMAT_CHOICES  # noqa: E402
from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid import HybridExperts  # noqa: E402
from ftexpert.gpu_worker.backends.offload import HostExperts  # noqa: E402

# offload (the decode path is not measured here), and HybridExperts over a CPU pool (--hybrid-fraction,
# --cpu-workers): a chunk of at most its cpu_max_tokens (512) splits its misses with the CPU pool, a longer one runs
# as offload
VARIANTS = ("offload", "hybrid")


def _fetched(backend) -> int:
    if backend is None:
        return 0
    if isinstance(backend, HybridExperts):
        return backend.counters()["experts_fetched_total"]
    backend.collect_copy_time()            # folds the device counters in (a sync, outside the timing)
    return backend.stats.fetched


def ttft_run(engine: Engine, prompt: list[int], backend) -> dict:
    """One request of one new token: seconds from add_request to that token, and experts copied meanwhile."""
    before = _fetched(backend)
    _sync()
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0))
    tokens = []
    while not tokens:
        tokens += [out.new_token_id for out in engine.step()]
    _sync()
    ttft = time.perf_counter() - t0
    while engine.has_work():               # (the request finished with its token; nothing left)
        engine.step()
    return {"ttft_s": ttft, "token": tokens[0], "fetched": _fetched(backend) - before}


def measure(engine: Engine, prompt: list[int], runs: int, backend=None) -> dict:
    ttft_run(engine, prompt, backend)                                   # warm-up
    results = [ttft_run(engine, prompt, backend) for _ in range(runs)]
    ttfts = [r["ttft_s"] for r in results]
    median = sorted(results, key=lambda r: r["ttft_s"])[len(results) // 2]
    return {**median, "all_ttft_s": [round(t, 3) for t in ttfts],
            "same_token": len({r["token"] for r in results}) == 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--expert-format", default="auto", choices=EXPERT_FORMAT_CHOICES,
                        help="the experts' format (auto: bf16 for a preset; quantized while loading otherwise)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--chunks", default="512,1024", help="prefill chunk sizes (tokens), comma-separated")
    parser.add_argument("--fractions", default="0.1,0.5", help="offload cache sizes (fractions of all experts)")
    parser.add_argument("--variants", default="offload",
                        help=f"backends besides resident, comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--attention", default="auto",
                        help="prefill attention for the resident rows, comma-separated: auto (flash with a causal bias "
                             "object where it applies), bias (the folded bias); attention.PREFILL_KERNEL")
    parser.add_argument("--hybrid-fraction", type=float, default=0.4,
                        help="hybrid variant: the fetch fraction f (the rest of each layer's misses go to the CPU pool)")
    parser.add_argument("--cpu-workers", type=int, default=1, help="hybrid variant: CPU expert processes")
    parser.add_argument("--routing", default="zipf:1.0", help="as bench_engine.py's --routing")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    kernels = [a.strip() for a in args.attention.split(",") if a.strip()]
    bad = [v for v in variants if v not in VARIANTS] + [a for a in kernels if a not in attention.PREFILL_KERNELS]
    if bad or not chunks or min(chunks) < 1 or not kernels:
        raise SystemExit(f"--variants takes {', '.join(VARIANTS)}; --attention "
                         f"{', '.join(attention.PREFILL_KERNELS)}; --chunks positive integers "
                         f"(got {args.variants!r}, {args.attention!r}, {args.chunks!r})")
    gen = torch.Generator().manual_seed(0)
    base = spec_from_args(argparse.Namespace(), preset=args.preset, device=args.device, expert_format=args.expert_format,
                          max_running_requests=1, max_context_tokens=args.prompt_tokens + 16, routing=args.routing,
                          cuda_graphs="off", moe_prefetch="off")
    built = build_engine(base)
    cfg = built.cfg
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    rows = []                    # (name, chunk, result, roofline_s or None)
    reference = {}
    def tag(kernel: str) -> str:
        return f" attn-{kernel}" if len(kernels) > 1 else ""

    for kernel in reversed(kernels):             # the first last: the offload rows run with it
        attention.PREFILL_KERNEL = kernel
        for chunk in chunks:
            engine = built.fresh_engine(dataclasses.replace(base, prefill_chunk_tokens=chunk))
            res = measure(engine, prompt, args.runs)
            reference.setdefault(chunk, {})[kernel] = res["token"]
            rows.append(("resident" + tag(kernel), chunk, res, None))
            print(f"resident{tag(kernel)} chunk {chunk}: TTFT {res['all_ttft_s']} s", flush=True)
            del engine
    source = built.source.experts
    expert_bytes = source.layout.expert_nbytes
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    if fractions:
        built.release_experts()          # the resident experts' GPU memory, before the host store is filled
    host = HostExperts.create_filled(source, staging_device=args.device) if fractions else None   # (resident only: none)
    bw = pcie_store_bandwidth(host)[0] if args.device == "cuda" and host is not None else 1e9
    pool = None        # started before the first hybrid row: it pins this process to the reserved CPUs, so the
    try:               # offload rows run first, unpinned, as in the other sections' runs
        runs = sorted([(f, v, c) for f in fractions for v in variants for c in chunks],
                      key=lambda run: run[1] == "hybrid")                               # hybrid rows last
        for frac, variant, chunk in runs:
            hybrid = variant == "hybrid"
            if hybrid and pool is None:
                resources = ExpertResources.over_store(host.store, "hybrid", top_k=cfg.top_k, model_dtype=host.layout.dtype,
                                                       cpu=CpuWorkerSettings(num_workers=args.cpu_workers))
                resources.start_cpu_workers()
                pool = attach_cpu_pool(host.store, resources.channel_names, worker_info=resources.worker_info)
            # the last row's backend closed first; the store and the pool are borrowed (closed below)
            built = build_engine(dataclasses.replace(base, moe_strategy=variant, moe_cache_size=repr(frac),
                                                     prefill_chunk_tokens=chunk),
                                 attachment=Attachment(host=host, pool=pool), reuse=built, pin_driving_process=False,
                                 hybrid=HybridOptions(fetch_fraction=args.hybrid_fraction) if hybrid else None)
            backend = built.experts
            res = measure(built.engine, prompt, args.runs, backend)
            res["lossless"] = res["token"] == reference[chunk][kernels[0]]
            name = f"{variant} {frac:.0%}" + (f" f={args.hybrid_fraction:g}" if hybrid else "")
            # (a hybrid chunk the CPU shares has no PCIe-only roofline: its roofline columns show -)
            pieces = [min(chunk, args.prompt_tokens - i) for i in range(0, args.prompt_tokens, chunk)]
            as_offload = not hybrid or min(pieces) > backend.cpu_max_tokens
            roof = res["fetched"] * expert_bytes / bw if as_offload else None   # (PCIe alone)
            rows.append((name, chunk, res, roof))
            print(f"{name} chunk {chunk}: TTFT {res['all_ttft_s']} s, {res['fetched']} experts copied",
                  flush=True)
            del backend
    finally:
        built.close()                          # the last backend (its doorbells; not the store, not the pool)
        if pool is not None:
            pool.close()
            resources.close()                  # the CPU workers stopped, their channels unlinked
        if host is not None:
            host.close()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    pcie = (f"; PCIe {bw / 1e9:.1f} GB/s (DMA copies of distinct store experts back to back)"
            if host is not None else "")
    print(f"\n{args.preset} {source.layout.dtype}, {device}, torch {torch.__version__}, prompt {args.prompt_tokens} "
          f"tokens, greedy, routing {args.routing}, median of {args.runs} runs after a warm-up; expert "
          f"{expert_bytes / 1e6:.2f} MB{pcie}")
    print(f"{'backend':<27} {'chunk':>5} {'TTFT s':>7} {'tok/s':>7} {'copied':>7} {'GB':>6} {'roof s':>6} "
          f"{'%roof':>5} {'lossless':>8}")
    for name, chunk, r, roof in rows:
        pct = f"{100 * roof / r['ttft_s']:>5.0f}" if roof else f"{'-':>5}"
        print(f"{name:<27} {chunk:>5} {r['ttft_s']:>7.3f} {args.prompt_tokens / r['ttft_s']:>7.0f} "
              f"{r['fetched']:>7} {r['fetched'] * expert_bytes / 1e9:>6.1f} "
              f"{(f'{roof:.3f}' if roof else '-'):>6} {pct} {str(r.get('lossless', '-')):>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
