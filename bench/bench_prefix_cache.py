"""Prefix-cache and long-context benchmark of the engine's paged KV cache (engine/README.md, "KV cache").

Two measurements, each on one engine built by `build_engine` (any model, preset, device and expert strategy):

- TTFT of a chat turn: a conversation holds `--history-tokens` tokens (a first turn prefilled and answered with
  `--answer-tokens` tokens); the next turn adds `--turn-tokens` tokens. Its time to first token with the prefix
  cache off (the whole history prefilled again) and on (the history's full blocks found cached, only the rest
  prefilled), median of `--runs` conversations (each with fresh random tokens, so no run finds another's blocks).
- decode tokens / s of one request at each context of `--decode-contexts` (prompt of that many tokens, then
  `--decode-tokens` tokens; a warm-up request at the same context first, so that CUDA graphs are captured).
- a batch (`--batch B --batch-context C`): B requests of C-token prompts decoding together on an engine that offers
  `--batch-max-context` tokens a request, its KV pool `--kv-cache-gib`: the pool's bytes beside what one fixed row
  of the longest context per request slot would take (B x max context), and the batch's decode tokens / s.

Usage (GPU, the measurements engine/README.md lists as still to be taken):
    python bench/bench_prefix_cache.py --preset qwen3-30b-a3b --device cuda --moe-strategy resident \\
        --history-tokens 32768 --turn-tokens 500 --decode-contexts 1024,32768,131072 --kv-cache-gib 24
    python bench/bench_prefix_cache.py --preset qwen3-30b-a3b --device cuda --moe-strategy offload \\
        --moe-cache-size 0.25 --history-tokens 32768 --turn-tokens 500 --decode-contexts 1024,32768
On the CPU, with the embedded default model (its context: 4,096 positions):
    python bench/bench_prefix_cache.py --device cpu --history-tokens 1024 --turn-tokens 64 --decode-contexts 256,1024
Prints one line per measurement and, with --json-out, writes them as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR, build_engine  # noqa: E402
from ftexpert.gpu_worker.engine import Engine, SamplingParams  # noqa: E402
from ftexpert.gpu_worker.engine.kv_cache import KVCache  # noqa: E402
from ftexpert.proto.engine_spec import EngineSpec, routing_flag  # noqa: E402
from ftexpert.proto.knobs import EXPERT_FORMAT_CHOICES  # noqa: E402

try:                                  # run as bench/bench_prefix_cache.py (bench/ on sys.path) or imported from bench
    from hbm_roofline import describe, hbm_bandwidth, routed_experts_per_layer, step_bytes  # noqa: E402
    from kernel_table import gpu_kernel_table  # noqa: E402
except ImportError:
    from bench.hbm_roofline import describe, hbm_bandwidth, routed_experts_per_layer, step_bytes  # noqa: E402
    from bench.kernel_table import gpu_kernel_table  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--preset", default=None, help="a real model's shape with random weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--expert-format", default="auto", choices=EXPERT_FORMAT_CHOICES,
                   help="the experts' format (auto: the checkpoint's or the preset's)")
    p.add_argument("--moe-strategy", default="resident", choices=("resident", "offload"))
    p.add_argument("--moe-cache-size", default=None)
    p.add_argument("--kv-block-size", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--history-tokens", type=int, default=32768)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--turn-tokens", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--decode-contexts", default="1024,32768,131072", help="comma-separated; empty: none")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=0, help="requests decoding together; 0: no batch row")
    p.add_argument("--batch-context", type=int, default=8192, help="each batched request's prompt tokens")
    p.add_argument("--batch-max-context", type=int, default=131072,
                   help="the context a request may reach on the batch's engine (its block tables' length)")
    p.add_argument("--routing", type=routing_flag, default="model",
                   help="model (the preset's router; random weights route nearly every token alike), zipf[:SKEW] or "
                        "trace:FILE (gpu_worker/models/synthetic_routing.py), as bench_engine.py --routing")
    p.add_argument("--profile", action="store_true",
                   help="one more turn of each kind, profiled (torch.profiler): its GPU kernels, and the host's time "
                        "outside them")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _first_token_s(engine: Engine, prompt: list[int], max_new: int, at_first=None) -> tuple[float, list[int]]:
    """Seconds from add_request to the request's first token, and all its tokens (run to the end); `at_first()`
    is called once the first token is out (the prefill done, the decode not begun)."""
    _sync()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, _greedy(max_new))
    ttft, tokens = None, []
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                tokens.append(out.new_token_id)
                if ttft is None:
                    ttft = time.perf_counter() - t0
                    if at_first is not None:
                        at_first()
    return ttft, tokens


def _copied(experts) -> tuple[int, int]:
    """(distinct misses, experts fetched) so far of an offload backend; (0, 0) for one without a slot cache."""
    if not hasattr(experts, "refresh_stats"):
        return 0, 0
    st = experts.refresh_stats()
    return st.distinct_misses, st.fetched


def chat_turn(engine: Engine, args, vocab: int, seed: int, experts=None, profiler=None) -> dict:
    """One conversation: a first turn of history, its answer, then the timed turn (and, for an offload backend,
    the experts it fetched: every expert a prefill chunk routes to and the cache lacks crosses PCIe); `profiler`:
    a torch.profiler.profile around the timed turn."""
    rng = random.Random(seed)
    history = _tokens(args.history_tokens, vocab, rng)
    _, answer = _first_token_s(engine, history, args.answer_tokens)
    hits0, restores0 = engine.stats.prefix_cache_hit_tokens_total, engine.stats.state_checkpoint_restores_total
    prompt = history + answer + _tokens(args.turn_tokens, vocab, rng)
    fetched0 = _copied(experts)[1]
    with profiler if profiler is not None else contextlib.nullcontext():
        ttft, _ = _first_token_s(engine, prompt, 1)
    return {"ttft_s": ttft, "prompt_tokens": len(prompt),
            "hit_tokens": engine.stats.prefix_cache_hit_tokens_total - hits0,
            "state_restores": engine.stats.state_checkpoint_restores_total - restores0,
            "experts_fetched": _copied(experts)[1] - fetched0}


def profile_turn(engine: Engine, args, vocab: int, seed: int, label: str) -> None:
    """One more conversation, its timed turn under torch.profiler: the GPU kernels of the turn's prefill and first
    token, and the turn's wall time beside their sum (what the host and idle gaps take)."""
    from torch.profiler import ProfilerActivity, profile      # lazy: only with --profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    ttft = chat_turn(engine, args, vocab, seed, profiler=prof)["ttft_s"]
    print(f"profile of a turn, prefix cache {label}: TTFT {ttft * 1e3:.1f} ms (profiled)", flush=True)
    for line in gpu_kernel_table(prof, 1, "turn", top=20):
        print(line, flush=True)


def decode_rate(engine: Engine, ctx: int, n: int, vocab: int, experts=None) -> tuple[float, float]:
    """(decode tokens / s, distinct misses a decode token: 0 without a slot cache) of one request after a
    `ctx`-token prompt (a warm-up request at the same context first); the misses from its first token on."""
    rng = random.Random(ctx)
    misses0 = [0]
    for _ in range(2):                                   # the first: warm-up (graph capture)
        s = engine.stats
        tokens0, time0 = s.decode_tokens, s.decode_time_s
        _first_token_s(engine, _tokens(ctx, vocab, rng), n,
                       at_first=lambda: misses0.__setitem__(0, _copied(experts)[0]))
    tokens = s.decode_tokens - tokens0
    return tokens / (s.decode_time_s - time0), (_copied(experts)[0] - misses0[0]) / max(1, tokens)


def batch_rate(engine: Engine, batch: int, ctx: int, n: int, vocab: int) -> tuple[float, int]:
    """Decode tokens / s of `batch` requests of `ctx`-token prompts running together (a warm-up batch first), and
    the most KV blocks they held at once."""
    rng = random.Random(batch * ctx)
    peak = 0
    for _ in range(2):                                   # the first: warm-up (graph capture at this batch)
        s = engine.stats
        tokens0, time0 = s.decode_tokens, s.decode_time_s
        for _ in range(batch):
            engine.add_request(_tokens(ctx, vocab, rng), _greedy(n))
        while engine.has_work():
            engine.step()
            peak = max(peak, engine.blocks.pool.num_used)
    return (s.decode_tokens - tokens0) / (s.decode_time_s - time0), peak


def main(argv=None) -> int:
    args = parse_args(argv)
    contexts = [int(c) for c in args.decode_contexts.split(",") if c.strip()]
    need = max([args.history_tokens + args.answer_tokens + args.turn_tokens + 1]
               + [c + args.decode_tokens for c in contexts])
    model = args.model or (None if args.preset else str(DEFAULT_MODEL_DIR))
    spec = EngineSpec(model=model, preset=args.preset, device=args.device, dtype=args.dtype,
                      expert_format=args.expert_format,
                      moe_strategy=args.moe_strategy, moe_cache_size=args.moe_cache_size, max_running_requests=1,
                      max_context_tokens=need, kv_block_size=args.kv_block_size, kv_cache_gib=args.kv_cache_gib,
                      routing=args.routing)
    built = build_engine(spec)
    rows = []
    try:
        model, engine = built.model, built.engine
        vocab = model.cfg.vocab_size
        experts = built.experts
        print(f"{type(experts).__name__} on {built.device}; KV pool {engine.kv.num_blocks} blocks of "
              f"{engine.kv.block_size} ({engine.kv.nbytes / 2**30:.2f} GiB); context {need}; routing {args.routing}",
              flush=True)
        for prefix in (False, True):
            built.engine = engine = None                 # one KV pool at a time
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            engine = built.fresh_engine(dataclasses.replace(spec, prefix_cache="on" if prefix else "off"))
            turns = [chat_turn(engine, args, vocab, seed=run, experts=experts)
                     for run in range(args.runs + 1)][1:]                                      # the 1st: warm-up
            ttft = statistics.median(t["ttft_s"] for t in turns)
            fetched = statistics.median(t["experts_fetched"] for t in turns)
            row = {"what": "chat turn", "prefix_cache": prefix, "ttft_s": ttft, "runs": len(turns),
                   "prompt_tokens": turns[0]["prompt_tokens"], "hit_tokens": turns[0]["hit_tokens"],
                   "experts_fetched": fetched, "state_restores": turns[0]["state_restores"]}
            rows.append(row)
            if args.profile:
                profile_turn(engine, args, vocab, 1000 + prefix, "on" if prefix else "off")
            print(f"turn of +{args.turn_tokens} tokens to {args.history_tokens}: prefix cache "
                  f"{'on ' if prefix else 'off'} TTFT {ttft * 1e3:9.1f} ms (median of {len(turns)}), "
                  f"{row['hit_tokens']} of {row['prompt_tokens']} prompt tokens found cached"
                  + (f", {fetched:.0f} experts fetched" if hasattr(experts, "refresh_stats") else "")
                  + (", the linear layers' state restored" if row["state_restores"] else ""), flush=True)
        bw = hbm_bandwidth() if engine.device.type == "cuda" and args.moe_strategy == "resident" else None
        for ctx in contexts:
            rate, misses = decode_rate(engine, ctx, args.decode_tokens, vocab, experts)
            row = {"what": "decode", "context": ctx, "tokens_per_s": rate}
            note = ""
            if hasattr(experts, "refresh_stats"):
                row["misses_per_token"] = misses
                note = f"; {misses:.1f} misses a token"
            if bw is not None:           # the resident step's bound at this context (bench/hbm_roofline.py)
                mid = ctx + args.decode_tokens // 2                      # the request's mean context while decoding
                steps = [[ctx + s] for s in range(args.decode_tokens)]
                parts = step_bytes(model, built.source.experts.layout.expert_nbytes, [mid],
                                   routed_experts_per_layer(model, steps))
                roof = bw / parts["total"]
                row.update(hbm_roofline_tok_s=roof, step_bytes=parts, hbm_bytes_per_s=bw)
                note = f"; {describe(parts, bw)}: {roof:.1f} tok/s, {100 * rate / roof:.0f}% of it"
            rows.append(row)
            print(f"decode at a {ctx}-token context: {rate:8.1f} tok/s{note}", flush=True)
        if args.batch:
            built.engine = engine = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            bspec = dataclasses.replace(spec, max_running_requests=args.batch,
                                        max_context_tokens=args.batch_max_context)
            engine = built.fresh_engine(bspec)
            fixed = KVCache.nbytes_for(model.cfg, args.batch * args.batch_max_context, engine.kv.k.dtype)
            rate, peak = batch_rate(engine, args.batch, args.batch_context, args.decode_tokens, vocab)
            rows.append({"what": "batch", "batch": args.batch, "context": args.batch_context,
                         "max_context": args.batch_max_context, "tokens_per_s": rate,
                         "pool_bytes": engine.kv.nbytes, "fixed_rows_bytes": fixed, "peak_blocks": peak,
                         "block_bytes": engine.kv.groups[0].nbytes // engine.kv.num_blocks})
            print(f"batch {args.batch} at a {args.batch_context}-token context (requests may reach "
                  f"{args.batch_max_context}): {rate:8.1f} tok/s together; KV pool {engine.kv.nbytes / 2**30:.2f} GiB, "
                  f"peak {peak} of {engine.kv.num_blocks} blocks in use; fixed rows of the longest context would take "
                  f"{fixed / 2**30:.1f} GiB", flush=True)
    finally:
        built.close()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
