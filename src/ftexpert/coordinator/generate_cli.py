"""`ft generate`: load a model and run one completion through the engine, in one process.

The host-side resources (the expert store; the CPU workers, their channels and their supervisor) come from
their one owner (coordinator/expert_resources.py), as under `ft serve`; the engine attaches to them
(gpu_worker/api.py).

    ft generate --prompt "Hello" --max-new-tokens 32                 # the embedded default model
    ft generate --model /models/Qwen3-30B-A3B --prompt-ids 1,2,3 --json
    ft generate --preset qwen3-30b-a3b --prompt-ids 1,2,3 --device cuda   # random weights, real shape
    ft generate --moe-strategy hybrid --fetch-fraction 0.6 --num-cpu-workers 1 --prompt "Hi"   # docs/HYBRID.md

With --json the last stdout line is one JSON object: token_ids, text, finish_reason and timing.
Torch is imported only inside ``run`` so that ``ft --help`` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from ftexpert.proto.cli_flags import add_cpu_threads_flag, add_fetch_fraction_flag
from ftexpert.proto.engine_spec import EngineSpec, add_engine_flags, spec_from_args
from ftexpert.proto.knobs import add_cli_flag, resolve

def _int_list(raw: str) -> list[int]:
    try:
        return [int(t) for t in raw.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of integers") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser, max_running_requests=1)   # the model, the experts, the engine: proto/engine_spec.py
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the model's tokenizer.json)")
    prompt.add_argument("--prompt-ids", metavar="IDS", type=_int_list, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template as a user turn")
    samp = parser.add_argument_group("sampling")
    samp.add_argument("--max-new-tokens", type=int, default=64)
    samp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--top-k", type=int, default=0, help="0 = off")
    samp.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    samp.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    samp.add_argument("--stop-token-ids", type=_int_list, default=[], metavar="IDS")
    hyb = parser.add_argument_group("cpu and hybrid strategies (docs/HYBRID.md)")
    add_fetch_fraction_flag(hyb)
    hyb.add_argument("--no-promote", action="store_true", help="no recency promotion (docs/slot_cache.md)")
    add_cpu_threads_flag(hyb)
    hyb.add_argument("--cpu-deadline-ms", type=float, default=1000.0,
                     help="a CPU share not answered within this is fetched instead (the worker is restarted)")
    add_cli_flag(hyb, "fetch_round")
    add_cli_flag(hyb, "benchbw_path")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def hybrid_options(args: argparse.Namespace):
    """HybridOptions from the flags; knobs by precedence flag > FREETOKEN_* environment > default."""
    # lazy: torch and the GPU worker load only when the command runs (`ft --help` start-up time)
    from ftexpert.gpu_worker.api import HybridOptions

    knobs = resolve({k: getattr(args, k, None) for k in ("fetch_round", "benchbw_path")})
    return HybridOptions(fetch_fraction=args.fetch_fraction, fetch_round=knobs["fetch_round"],
                         promote=not args.no_promote, cpu_deadline_s=args.cpu_deadline_ms / 1e3,
                         benchbw_path=knobs["benchbw_path"])   # the reserved CPUs and the pin: the engine spec


def cpu_worker_settings(args: argparse.Namespace, spec: EngineSpec):
    # lazy: the host resources' modules (numpy) load only when the command runs (`ft --help` start-up time)
    from ftexpert.coordinator.expert_resources import CpuWorkerSettings
    from ftexpert.cpu_expert_pool.api import default_worker_count

    return CpuWorkerSettings(num_workers=spec.num_cpu_workers or default_worker_count(), threads=args.cpu_threads,
                             reserve_cpus=spec.reserve_cpus, act_quant=spec.cpu_act_quant)


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        if args.chat:
            raise ValueError("--chat needs --prompt text, not --prompt-ids")
        return args.prompt_ids
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json, so --prompt text cannot be encoded; "
                         "pass --prompt-ids instead")
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def run(args: argparse.Namespace) -> int:
    # lazy: torch and the GPU worker load only when the command runs (`ft --help` start-up time)
    from ftexpert.coordinator.expert_resources import HOST_STORE_STRATEGIES, ExpertResources
    from ftexpert.coordinator.serve_cli import use_default_model
    from ftexpert.gpu_worker.api import Attachment, build_engine, open_model_source, resolve_device

    use_default_model(args)
    t_start = time.perf_counter()
    spec = spec_from_args(args)
    device = resolve_device(spec.device)
    source = open_model_source(spec.model, spec.preset, dtype=spec.dtype, seed=spec.seed_weights, device=device,
                               expert_format=spec.expert_format)
    prompt = _prompt_ids(args, source.tokenizer)
    if spec.max_context_tokens is None:      # just what this request can use, up to 32K and the model's context
        wanted = max(len(prompt), min(len(prompt) + args.max_new_tokens, 32768))
        spec = dataclasses.replace(spec, max_context_tokens=min(wanted, source.cfg.context_length))
    resources = None
    try:
        attachment = None
        if spec.moe_strategy in HOST_STORE_STRATEGIES:
            resources = ExpertResources.create(source, spec.moe_strategy, store_name=f"ft-generate-{os.getpid()}",
                                               cpu=cpu_worker_settings(args, spec) if spec.uses_cpu_pool else None,
                                               staging_device=device if device.type == "cuda" else None)
            resources.start_cpu_workers()
            attachment = Attachment(resources.store_name, tuple(resources.channel_names), resources.worker_info)
        built = build_engine(spec, source=source, attachment=attachment,
                             hybrid=hybrid_options(args) if spec.uses_cpu_pool else None)
        try:
            return _generate(args, spec, built, prompt, t_start, load_s=time.perf_counter() - t_start)
        finally:
            built.close()                # detaches from the store and the channels
    finally:
        if resources is not None:
            resources.close()            # the CPU workers stopped, the channels and the store unlinked


def _generate(args: argparse.Namespace, spec: EngineSpec, built, prompt: list[int], t_start: float,
              load_s: float) -> int:
    # lazy: torch and the GPU worker load only when the command runs (`ft --help` start-up time)
    from ftexpert.gpu_worker.api import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                            stop_token_ids=tuple(args.stop_token_ids))
    tokenizer = built.source.tokenizer
    engine = built.engine
    t_run = time.perf_counter()
    engine.add_request(prompt, params)
    tokens: list[int] = []
    ttft_s, finish_reason, printed = None, None, ""
    while engine.has_work():
        for _, token, _, reason, _ in engine.step():
            ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - t_run
            tokens.append(token)
            finish_reason = reason
            if not args.json and tokenizer is not None:
                printed = _stream(tokenizer.decode(tokens), printed)
    total_s = time.perf_counter() - t_run
    text = tokenizer.decode(tokens) if tokenizer is not None else ""
    s = engine.stats
    timing = {"load_s": load_s, "ttft_s": ttft_s, "prefill_s": s.prefill_time_s,
              "decode_s": s.decode_time_s, "generate_s": total_s,
              "total_s": time.perf_counter() - t_start,
              "prefill_tokens_per_s": s.prefill_tokens_per_s, "decode_tokens_per_s": s.decode_tokens_per_s}
    experts = built.experts
    expert_stats = experts.counters() or None      # the backend's counters (hits, misses, fetched, bytes, ...)
    if expert_stats is not None and expert_stats.get("copy_time_s_total"):
        expert_stats["copy_gb_per_s"] = expert_stats["copy_bytes_total"] / expert_stats["copy_time_s_total"] / 1e9
    if spec.uses_cpu_pool:                         # the split policy and where f came from
        expert_stats.update(policy=dict(experts.policy), fetch_fraction_source=experts.fetch_fraction_source)
    if args.json:
        print(json.dumps({"token_ids": tokens, "experts": expert_stats, "text": text, "prompt_token_ids": prompt,
                          "finish_reason": finish_reason, "model": built.source.description,
                          "device": str(built.device), "moe_strategy": spec.moe_strategy,
                          "expert_format": built.source.expert_format.label,
                          "timing": timing}))
    else:
        if tokenizer is None:
            print(" ".join(map(str, tokens)))
        else:
            _stream(text, printed)
            print()
        print(f"[{len(tokens)} tokens, {finish_reason}; load {timing['load_s']:.2f} s, "
              f"prefill {len(prompt)} tokens {s.prefill_time_s:.3f} s, "
              f"decode {s.decode_tokens_per_s:.1f} tok/s on {built.device}; {built.source.description}]",
              file=sys.stderr)
    return 0


def _stream(text: str, printed: str) -> str:
    """Print the part of ``text`` not printed yet; hold back a trailing incomplete UTF-8 character."""
    if text.endswith("\ufffd") or not text.startswith(printed):
        return printed
    sys.stdout.write(text[len(printed):])
    sys.stdout.flush()
    return text
