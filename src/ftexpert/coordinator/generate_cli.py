"""`ft generate`: load a model and run one completion through the engine, in one process.

The host-side resources (the expert store; the CPU workers, their channels and their supervisor) come from
their one owner (coordinator/expert_resources.py), as under `ft serve`; the engine attaches to them
(gpu_worker/api.py).

    ft generate --prompt "Hello" --max-new-tokens 32                 # the embedded default model
    ft generate --model /models/Qwen3-30B-A3B --prompt-ids 1,2,3 --json
    ft generate --preset qwen3-30b-a3b --prompt-ids 1,2,3 --device cuda   # random weights, real shape
    ft generate --moe-strategy hybrid --fetch-fraction 0.6 --cpu-workers 1 --prompt "Hi"   # docs/HYBRID.md

With --json the last stdout line is one JSON object: token_ids, text, finish_reason and timing.
Torch is imported only inside ``run`` so that ``ft --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ftexpert.proto.knobs import add_cli_flags, positive_int_flag, resolve

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
PRESET_CHOICES = ("tiny", "qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b", "qwen3-next-80b-a3b", "gpt-oss-20b",
                  "gpt-oss-120b")   # gpu_worker/checkpoint/presets.py
STRATEGY_CHOICES = ("resident", "offload", "cpu", "hybrid")   # gpu_worker/assembly/backends.py


def _int_list(raw: str) -> list[int]:
    try:
        return [int(t) for t in raw.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of integers") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("model (neither: the embedded default model, a small trained MoE)")
    src.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (safetensors)")
    src.add_argument("--preset", choices=PRESET_CHOICES,
                     help="a real model's shape with seeded random weights, made in memory; with --model, "
                          "written to DIR first if DIR has no config.json")
    src.add_argument("--seed-weights", type=int, default=0, help="seed of a preset's random weights")
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
    run_g = parser.add_argument_group("engine")
    run_g.add_argument("--moe-strategy", choices=STRATEGY_CHOICES, default="resident",
                       help="resident: every expert on the device; offload: fetch every miss; cpu: compute every "
                            "miss in the CPU pool; hybrid: split the misses by --fetch-fraction")
    run_g.add_argument("--moe-cache-size", type=str, default=None, metavar="N|FRACTION",
                       help="GPU expert slots (offload, cpu, hybrid; default 0.25 of all experts)")
    run_g.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    run_g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: the checkpoint's")
    run_g.add_argument("--max-context-tokens", type=int, default=None,
                       help="KV cache length (default: prompt + max new tokens)")
    run_g.add_argument("--prefill-chunk-tokens", type=positive_int_flag, default=None,
                       help="prompt tokens a prefill chunk takes (default: 4096; with --moe-strategy cpu, the CPU share's "
                            "token limit, 512, so that chunks keep their CPU share)")
    hyb = parser.add_argument_group("cpu and hybrid strategies (docs/HYBRID.md)")
    hyb.add_argument("--fetch-fraction", type=float, default=None, metavar="F",
                     help="share of the misses fetched over PCIe, in [0, 1] (default: from the `ft bench bw` "
                          "profile of this GPU and expert format, else 0.5)")
    hyb.add_argument("--no-promote", action="store_true", help="no recency promotion (docs/slot_cache.md)")
    hyb.add_argument("--cpu-workers", type=int, default=1, metavar="N", help="CPU expert worker processes")
    hyb.add_argument("--cpu-threads", type=int, default=0, help="threads per CPU worker (0: one per core)")
    hyb.add_argument("--cpu-deadline-ms", type=float, default=1000.0,
                     help="a CPU share not answered within this is fetched instead (the worker is restarted)")
    hyb.add_argument("--reserve-cpus", default=None, metavar="LIST",
                     help="CPUs kept free of CPU workers, where this process pins itself (--pin-gpu-worker; "
                          "default: 0 on machines with >= 4 CPUs)")
    add_cli_flags(parser)               # --fetch-round, ... (FREETOKEN_* knobs)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def hybrid_options(args: argparse.Namespace):
    """HybridOptions from the flags; knobs by precedence flag > FREETOKEN_* environment > default."""
    from ftexpert.gpu_worker.api import HybridOptions

    knobs = resolve({k: getattr(args, k, None) for k in ("fetch_round", "benchbw_path", "pin_gpu_worker")})
    return HybridOptions(fetch_fraction=args.fetch_fraction, fetch_round=knobs["fetch_round"],
                         promote=not args.no_promote,
                         cpu_deadline_s=args.cpu_deadline_ms / 1e3, reserve_cpus=args.reserve_cpus,
                         benchbw_path=knobs["benchbw_path"], pin_gpu_worker=knobs["pin_gpu_worker"] == "on")


def cpu_worker_settings(args: argparse.Namespace):
    from ftexpert.coordinator.expert_resources import CpuWorkerSettings

    if args.cpu_workers < 1:
        raise ValueError(f"--cpu-workers {args.cpu_workers} must be an int >= 1")
    return CpuWorkerSettings(num_workers=args.cpu_workers, threads=args.cpu_threads, reserve_cpus=args.reserve_cpus)


def prefetch_settings(args: argparse.Namespace):
    """The lookahead prefetch's settings from --moe-prefetch* / FREETOKEN_MOE_PREFETCH* (None: off)."""
    from ftexpert.gpu_worker.api import PREFETCH_KNOBS, settings_from_knobs
    return settings_from_knobs(resolve({f: getattr(args, f, None) for f in PREFETCH_KNOBS}))


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
    from ftexpert.coordinator.expert_resources import ExpertResources
    from ftexpert.coordinator.serve_cli import use_default_model

    use_default_model(args)
    t_start = time.perf_counter()
    hybrid = hybrid_options(args) if args.moe_strategy in ("cpu", "hybrid") else None
    cpu = cpu_worker_settings(args) if hybrid is not None else None
    from ftexpert.kernels.pdl import apply_setting
    apply_setting(resolve({"pdl": args.pdl})["pdl"], args.device)
    eviction = resolve({"eviction_freq_weight": args.eviction_freq_weight,
                        "eviction_freq_half_life": args.eviction_freq_half_life})
    from ftexpert.gpu_worker.api import load_attached_model, open_model_source, resolve_device

    device = resolve_device(args.device)
    source = open_model_source(args.model, args.preset, dtype=args.dtype, seed=args.seed_weights, device=device,
                               expert_format=resolve({"expert_format": args.expert_format})["expert_format"])
    resources = ExpertResources.create(source, args.moe_strategy, store_name=f"ft-generate-{os.getpid()}", cpu=cpu,
                                       staging_device=device if device.type == "cuda" else None)
    try:
        resources.start_cpu_workers()
        loaded = load_attached_model(source, device, moe_strategy=args.moe_strategy, store_name=resources.store_name,
                                     cpu_channels=resources.channel_names, moe_cache_size=args.moe_cache_size,
                                     hybrid=hybrid, pin_driving_process=True, worker_info=resources.worker_info,
                                     freq_weight=eviction["eviction_freq_weight"],
                                     freq_half_life=eviction["eviction_freq_half_life"],
                                     prefetch=prefetch_settings(args))
        try:
            return _generate(args, loaded, t_start, load_s=time.perf_counter() - t_start)
        finally:
            loaded.model.experts.close()        # detaches from the store and the channels
    finally:
        resources.close()               # the CPU workers stopped, the channels and the store unlinked


def _generate(args: argparse.Namespace, loaded, t_start: float, load_s: float) -> int:
    from ftexpert.gpu_worker.api import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                            stop_token_ids=tuple(args.stop_token_ids))
    tokenizer = loaded.tokenizer
    prompt = _prompt_ids(args, tokenizer)
    # Default KV length: just what this request can use, up to 32K (the engine stops at a full context).
    max_ctx = args.max_context_tokens or max(len(prompt), min(len(prompt) + args.max_new_tokens, 32768))
    slot_audit = resolve({"moe_slot_audit": args.moe_slot_audit})["moe_slot_audit"]
    overlap = resolve({"overlap_decode": args.overlap_decode})["overlap_decode"]
    engine = Engine(loaded.model, EngineConfig(max_running_requests=1, max_context_tokens=max_ctx,
                                               slot_audit_every=slot_audit,
                                               prefill_chunk_tokens=args.prefill_chunk_tokens,
                                               overlap_decode=None if overlap == "auto" else overlap == "on"),
                    eos_token_ids=loaded.eos_token_ids)
    t_run = time.perf_counter()
    engine.add_request(prompt, params)
    tokens: list[int] = []
    ttft_s, finish_reason, printed = None, None, ""
    while engine.has_work():
        for _, token, _, reason in engine.step():
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
    experts = loaded.model.experts
    expert_stats = experts.counters() or None      # the backend's counters (hits, misses, fetched, bytes, ...)
    if expert_stats is not None and expert_stats.get("copy_time_s_total"):
        expert_stats["copy_gb_per_s"] = expert_stats["copy_bytes_total"] / expert_stats["copy_time_s_total"] / 1e9
    if args.moe_strategy in ("cpu", "hybrid"):     # the split policy and where f came from
        expert_stats.update(policy=dict(experts.policy), fetch_fraction_source=experts.fetch_fraction_source)
    if args.json:
        print(json.dumps({"token_ids": tokens, "experts": expert_stats, "text": text, "prompt_token_ids": prompt,
                          "finish_reason": finish_reason, "model": loaded.source.description,
                          "device": str(loaded.device), "moe_strategy": args.moe_strategy,
                          "expert_format": loaded.source.expert_format.label,
                          "timing": timing}))
    else:
        if tokenizer is None:
            print(" ".join(map(str, tokens)))
        else:
            _stream(text, printed)
            print()
        print(f"[{len(tokens)} tokens, {finish_reason}; load {timing['load_s']:.2f} s, "
              f"prefill {len(prompt)} tokens {s.prefill_time_s:.3f} s, "
              f"decode {s.decode_tokens_per_s:.1f} tok/s on {loaded.device}; {loaded.source.description}]",
              file=sys.stderr)
    return 0


def _stream(text: str, printed: str) -> str:
    """Print the part of ``text`` not printed yet; hold back a trailing incomplete UTF-8 character."""
    if text.endswith("\ufffd") or not text.startswith(printed):
        return printed
    sys.stdout.write(text[len(printed):])
    sys.stdout.flush()
    return text
