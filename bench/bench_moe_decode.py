"""Micro-benchmark of kernels/moe_decode against the torch code it replaces, on one GPU.

MoE FFN at qwen3-30b-a3b shapes (E=128, H=2048, I=768, K=8, bf16), T = 1, 2, 4 tokens:
`moe_gemv` (reads the routed experts in place) against `gathered_expert_ffn` (copies them, then bmm).
Each case captures CALLS calls in one CUDA graph, each call with its own random routes (so that
consecutive calls do not find their experts in L2), and times graph replays with CUDA events;
the median per call is reported after warm-up. GB/s counts the weight bytes a call must read at
least (its distinct routed experts: w13 + w2), against the H200's HBM roofline (4.8 TB/s).
Then the fused RMSNorm, residual add + RMSNorm, q/k norm + rope and router against the torch
versions (layers.py), same method (their inputs stay in L2: these measure launches and latency).
`--sweep` also times GemvBlocks variants of moe_gemv (one knob group at a time).
Prints a short table last. Usage: python bench/bench_moe_decode.py [--tokens 1,2,4] [--sweep]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from graph_timing import add_graph_timing_args, time_graph  # bench/graph_timing.py (this folder is sys.path[0])

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM_ROOFLINE_BPS = 4.8e12          # H200 HBM3e peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,2,4", help="decode batch sizes T (comma-separated)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="expert intermediate size I")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    add_graph_timing_args(p)
    p.add_argument("--sweep", action="store_true", help="also time GemvBlocks variants of moe_gemv")
    p.add_argument("--skip-small", action="store_true", help="only the MoE FFN (no norm / rope / router)")
    p.add_argument("--json-out", default=None, help="write every result here as JSON")
    return p.parse_args(argv)


def moe_cases(args, dtype, rows: list[dict]) -> None:
    from gpu_worker.models.resident_experts import gathered_expert_ffn
    from kernels.moe_decode import DEFAULT_GEMV_BLOCKS, moe_gemv
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(E, 2 * I, H, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
    w2 = torch.empty(E, H, I, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    cpu_gen = torch.Generator().manual_seed(1)
    for T in [int(t) for t in args.tokens.split(",") if t]:
        ids = [torch.stack([torch.randperm(E, generator=cpu_gen)[:K] for _ in range(T)]).cuda()
               for _ in range(args.calls)]                                # [T, K] per call
        weights = torch.softmax(torch.randn(T, K, device="cuda"), -1)
        x = torch.randn(T, H, device="cuda").to(dtype)
        min_bytes = statistics.mean(int(torch.unique(i).numel()) for i in ids) * expert_bytes

        def add(name, blocks, fn):
            s = time_graph(fn, args.calls, args.reps, args.warmup)
            rows.append(dict(kind="moe", name=name, T=T, us=s * 1e6, gbps=min_bytes / s / 1e9,
                             roofline=min_bytes / s / HBM_ROOFLINE_BPS,
                             blocks=asdict(blocks) if blocks is not None else None))
            r = rows[-1]
            print(f"moe T={T} {name:<44} {r['us']:8.1f} us  {r['gbps']:7.0f} GB/s  "
                  f"{100 * r['roofline']:5.1f}% of {HBM_ROOFLINE_BPS / 1e12:.1f} TB/s", flush=True)

        add("gathered_expert_ffn (torch)", None, lambda i: gathered_expert_ffn(x, ids[i], weights, w13, w2))
        add("moe_gemv", DEFAULT_GEMV_BLOCKS, lambda i: moe_gemv(x, ids[i], weights, w13, w2))
        if args.sweep:
            b0 = DEFAULT_GEMV_BLOCKS
            variants = [replace(b0, gate_up_block_n=n, gate_up_block_k=k, gate_up_warps=w, gate_up_acc_2d=a)
                        for n in (8, 16, 32) for k in (128, 256, 512) for w in (4, 8) for a in (False, True)]
            variants += [replace(b0, down_block_n=n, down_block_k=k, down_warps=w, down_acc_2d=a)
                         for n in (8, 16, 32, 64) for k in (128, 256) for w in (4, 8) for a in (False, True)]
            for b in variants:
                if b == b0:
                    continue
                label = (f"gu n{b.gate_up_block_n} k{b.gate_up_block_k} w{b.gate_up_warps}"
                         f"{' 2d' if b.gate_up_acc_2d else ''} / dn n{b.down_block_n} k{b.down_block_k} "
                         f"w{b.down_warps}{' 2d' if b.down_acc_2d else ''}")
                try:
                    add(label, b, lambda i, b=b: moe_gemv(x, ids[i], weights, w13, w2, blocks=b))
                except Exception as exc:                              # e.g. out of resources
                    print(f"moe T={T} {label}: failed ({type(exc).__name__}: {exc})"[:200], flush=True)


def small_cases(args, dtype, rows: list[dict]) -> None:
    from gpu_worker.models.layers import apply_rope, rms_norm as torch_rms_norm
    from kernels.moe_decode import add_rms_norm, qk_norm_rope, rms_norm, route_topk
    from kernels.moe_decode.reference import route_topk_reference
    H, Hq, Hkv, D, E, K = args.hidden, args.heads, args.kv_heads, args.head_dim, args.experts, args.top_k
    eps = 1e-6
    for T in [int(t) for t in args.tokens.split(",") if t]:
        x = torch.randn(T, H, device="cuda").to(dtype)
        delta = torch.randn(T, H, device="cuda").to(dtype)
        w = torch.rand(H, device="cuda").to(dtype)
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda").to(dtype)
        q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        qw, kw = torch.rand(D, device="cuda").to(dtype), torch.rand(D, device="cuda").to(dtype)
        ang = torch.rand(T, 1, D, device="cuda") * 10
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        logits = torch.randn(T, E, device="cuda").to(dtype)

        def torch_add_norm(_):
            x2 = x + delta
            return x2, torch_rms_norm(x2, w, eps)

        def torch_qk(_):
            return (apply_rope(torch_rms_norm(q, qw, eps), cos, sin),
                    apply_rope(torch_rms_norm(k, kw, eps), cos, sin))

        cases = [
            ("rms_norm", lambda _: torch_rms_norm(x, w, eps), lambda _: rms_norm(x, w, eps)),
            ("add + rms_norm", torch_add_norm, lambda _: add_rms_norm(x, delta, w, eps)),
            ("q/k norm + rope", torch_qk, lambda _: qk_norm_rope(q, k, qw, kw, cos, sin, eps)),
            ("router softmax/top-k/renorm", lambda _: route_topk_reference(logits, K, True, True),
             lambda _: route_topk(logits, K, softmax_first=True, renorm=True)),
        ]
        for name, torch_fn, fused_fn in cases:
            t_torch = time_graph(torch_fn, args.calls, args.reps, args.warmup)
            t_fused = time_graph(fused_fn, args.calls, args.reps, args.warmup)
            rows.append(dict(kind="small", name=name, T=T, torch_us=t_torch * 1e6, fused_us=t_fused * 1e6))
            print(f"{name:<30} T={T}  torch {t_torch * 1e6:7.2f} us  fused {t_fused * 1e6:7.2f} us  "
                  f"x{t_torch / t_fused:5.2f}", flush=True)


def print_table(rows: list[dict]) -> None:
    moe = [r for r in rows if r["kind"] == "moe"]
    if moe:
        print("\n| MoE FFN | T | us / call | GB/s | % of 4.8 TB/s |")
        print("|---|---:|---:|---:|---:|")
        best: dict[int, dict] = {}
        for r in moe:
            if r["name"].startswith("gu "):
                if r["T"] not in best or r["us"] < best[r["T"]]["us"]:
                    best[r["T"]] = r
                continue
            print(f"| {r['name']} | {r['T']} | {r['us']:.1f} | {r['gbps']:.0f} | {100 * r['roofline']:.1f} |")
        for T, r in sorted(best.items()):
            print(f"| best sweep variant: {r['name']} | {T} | {r['us']:.1f} | {r['gbps']:.0f} | "
                  f"{100 * r['roofline']:.1f} |")
    small = [r for r in rows if r["kind"] == "small"]
    if small:
        print("\n| op | T | torch us | fused us | speedup |")
        print("|---|---:|---:|---:|---:|")
        for r in small:
            print(f"| {r['name']} | {r['T']} | {r['torch_us']:.2f} | {r['fused_us']:.2f} | "
                  f"{r['torch_us'] / r['fused_us']:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{args.dtype}, E={args.experts} H={args.hidden} I={args.inter} K={args.top_k}, "
          f"{args.calls} calls a graph, median of {args.reps} replays", flush=True)
    rows: list[dict] = []
    moe_cases(args, dtype, rows)
    torch.cuda.empty_cache()                                  # the experts of moe_cases are gone
    if not args.skip_small:
        small_cases(args, dtype, rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
