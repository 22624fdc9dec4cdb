"""How good the lookahead prefetch's predictions are on a trained checkpoint (its own routers): for each budget,
useful predictions per layer, precision, and the share of demand misses covered, on held-out text of the corpus.

    python bench/prefetch_quality.py                         # the embedded default model, on the CPU
    python bench/prefetch_quality.py --model DIR --device cuda --cache 0.25 --budgets 1,2,4,8

Per budget, two greedy runs over the same prompts on an offload backend at --cache: `measure` (the predictor's
choice counted against the next layer's routes, nothing installed: precision and useful predictions of the
predictor itself, coverage = useful / (useful + demand misses)) and `on` (installed and copied: the demand misses
per token it leaves, against prefetch off; its tokens are checked equal to off's). Figures over every decode
layer call that had a prediction (layers 1..L-1). Every engine is built by `build_engine(spec)`: the runs' offload
backends (the prefetch in their spec) over the first build's dense weights and one host store.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from ftexpert.gpu_worker.api import Attachment, SamplingParams, build_engine
from ftexpert.gpu_worker.backends.offload import HostExperts, resolve_cache_slots
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.workload.corpus import load_documents, split


def prompts_from_corpus(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of `count` held-out documents (the model never trained on them)."""
    _, held = split(load_documents())
    out = []
    for doc in held[:count]:
        ids = tokenizer.encode(doc)[:tokens]
        if len(ids) >= 8:
            out.append(ids)
    return out


def run(built, host, spec: EngineSpec, prompts, new_tokens: int):
    """Greedy tokens over an offload backend of `spec` (its cache and prefetch) on the shared store, and its counters;
    -> (the result, the engine built: the next run reuses its dense weights)."""
    built = build_engine(spec, attachment=Attachment(host=host), reuse=built)
    t0 = time.perf_counter()
    tokens = built.engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    c = built.experts.counters()
    out = {"tokens": tokens, "seconds": time.perf_counter() - t0, "misses": c["expert_misses_total"],
           "generated": sum(len(t) for t in tokens), **{k: c[k] for k in c if k.startswith("prefetch_")}}
    return out, built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", type=float, default=0.25, help="slot pool as a fraction of all experts")
    parser.add_argument("--budgets", default="1,2,4,8")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = EngineSpec(model=args.model, device=args.device, max_running_requests=1, max_context_tokens=1024,
                      moe_prefetch="off")
    built = build_engine(base)
    cfg = built.cfg
    prompts = prompts_from_corpus(built.source.tokenizer, args.prompts, args.prompt_tokens)
    built.release_experts()
    host = HostExperts.create_filled(built.source.experts, staging_device=None)
    slots = resolve_cache_slots(args.cache, cfg.num_layers, cfg.num_experts)
    offload = dataclasses.replace(base, moe_strategy="offload", moe_cache_size=repr(args.cache), moe_prefetch_k=args.k)
    try:
        off, built = run(built, host, offload, prompts, args.new_tokens)
        rows = []
        for budget in [int(b) for b in args.budgets.split(",") if b.strip()]:
            m, built = run(built, host, dataclasses.replace(offload, moe_prefetch="measure", moe_prefetch_budget=budget),
                           prompts, args.new_tokens)
            on, built = run(built, host, dataclasses.replace(offload, moe_prefetch="on", moe_prefetch_budget=budget),
                            prompts, args.new_tokens)
            useful, predicted, layers = (m["prefetch_useful_total"], m["prefetch_predicted_total"],
                                         m["prefetch_layer_calls_total"])
            rows.append({"budget": budget, "useful_per_layer": useful / layers if layers else 0.0,
                         "precision": useful / predicted if predicted else 0.0,
                         "covered_share": useful / (useful + m["misses"]) if useful + m["misses"] else 0.0,
                         "misses_per_token_off": off["misses"] / off["generated"],
                         "misses_per_token_on": on["misses"] / on["generated"],
                         "on_useful_per_layer": (on["prefetch_useful_total"] / on["prefetch_layer_calls_total"]
                                                 if on["prefetch_layer_calls_total"] else 0.0),
                         "lossless": on["tokens"] == off["tokens"] and m["tokens"] == off["tokens"]})
    finally:
        built.close()
        host.close()
    if args.json:
        print(json.dumps({"model": args.model or "default-moe", "cache": args.cache, "slots": slots,
                          "layers": cfg.num_layers, "experts": cfg.num_experts, "top_k": cfg.top_k, "rows": rows}))
        return 0
    print(f"{args.model or 'default-moe'}: {cfg.num_layers} layers x {cfg.num_experts} experts, top-{cfg.top_k}; "
          f"{slots} slots ({args.cache:.0%}); {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} greedy tokens each; K = {args.k}")
    print("| budget | useful / layer | precision | misses covered | misses/token off | on | lossless |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {r['useful_per_layer']:.2f} | {r['precision']:.2f} | {r['covered_share']:.0%} | "
              f"{r['misses_per_token_off']:.2f} | {r['misses_per_token_on']:.2f} | {r['lossless']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
