"""Micro-benchmark of kernels/moe_decode against the torch code it replaces, on one GPU.

MoE FFN at qwen3-30b-a3b shapes (E=128, H=2048, I=768, K=8, bf16), T = 1, 2, 4 tokens:
`moe_gemv` (reads the routed experts in place) against `gathered_expert_ffn` (copies them, then bmm).
Each case captures CALLS calls in one CUDA graph, each call with its own random routes (so that
consecutive calls do not find their experts in L2), and times graph replays with CUDA events;
the median per call is reported after warm-up. GB/s counts the weight bytes a call must read at
least (its distinct routed experts: w13 + w2), against the H200's HBM roofline (4.8 TB/s).
Then the fused RMSNorm, residual add + RMSNorm, q/k norm + rope and router against the torch
versions (layers.py), same method (their inputs stay in L2: these measure launches and latency).
Then the decode step's dense projections, qkv [(Hq + 2 Hkv) D, H], o_proj [H, Hq D] and the router
[E, H]: cuBLAS `F.linear` against `linear_gemv` (kernels/dense_gemv), each call of a graph with its
own weight tensor (CALLS of them, so that they do not sit in L2); GB/s counts the weight bytes.
`--sweep` also times GemvBlocks variants of moe_gemv (one knob group at a time) and LinearBlocks
variants of linear_gemv.
Prints a short table last. Usage: python bench/bench_moe_decode.py [--tokens 1,2,4] [--sweep]
[--linear-only | --skip-linear]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

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
    p.add_argument("--active", default="",
                   help="comma list of routes per token left on the GPU (the rest id -1), e.g. 8,2: an offload "
                        "layer's launch after its copy computes only the ~2 fetched routes (default: all K)")
    p.add_argument("--sweep", action="store_true",
                   help="also time GemvBlocks variants of moe_gemv and LinearBlocks variants of linear_gemv")
    p.add_argument("--skip-small", action="store_true", help="only the MoE FFN (no norm / rope / router)")
    p.add_argument("--skip-linear", action="store_true", help="no dense projections (linear_gemv vs F.linear)")
    p.add_argument("--linear-only", action="store_true", help="only the dense projections")
    p.add_argument("--linear-shapes", default="",
                   help="the dense projections as NAME=NxK,... instead of qkv / o_proj / router from --hidden, "
                        "--heads, --kv-heads, --head-dim (e.g. qwen3-next's: run_gpu.sh tuning)")
    p.add_argument("--json-out", default=None, help="write every result here as JSON")
    return p.parse_args(argv)


def gathered_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The torch code moe_gemv replaces: gather the T*K routed experts, then batched GEMVs."""
    T, K = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    xp = x.unsqueeze(1).expand(T, K, x.shape[1]).reshape(T * K, -1, 1)
    h = torch.bmm(w13.index_select(0, flat_ids), xp).squeeze(2)
    h = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).unsqueeze(2)
    y = torch.bmm(w2.index_select(0, flat_ids), h).squeeze(2)
    return (y.float() * topk_weights.reshape(-1, 1)).view(T, K, -1).sum(dim=1).to(x.dtype)


def moe_cases(args, dtype, rows: list[dict]) -> None:
    from ftexpert.kernels.moe_decode import DEFAULT_GEMV_BLOCKS, moe_gemv
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(E, 2 * I, H, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
    w2 = torch.empty(E, H, I, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    cpu_gen = torch.Generator().manual_seed(1)
    actives = [int(a) for a in args.active.split(",") if a.strip()] or [K]
    for T, A in [(int(t), a) for t in args.tokens.split(",") if t for a in actives]:
        ids = [torch.stack([torch.randperm(E, generator=cpu_gen)[:K] for _ in range(T)]).cuda()
               for _ in range(args.calls)]                                # [T, K] per call
        for i in ids:
            i[:, A:] = -1                                                 # routes not on the GPU: read nothing
        weights = torch.softmax(torch.randn(T, K, device="cuda"), -1)
        x = torch.randn(T, H, device="cuda").to(dtype)
        min_bytes = statistics.mean(int(torch.unique(i[i >= 0]).numel()) for i in ids) * expert_bytes
        tag = f" A={A}" if A != K else ""

        def add(name, blocks, fn):
            if name.startswith("gathered") and A != K:
                return                                                    # the gather path has no -1 routes
            s = time_graph(fn, args.calls, args.reps, args.warmup)
            rows.append(dict(kind="moe", name=name, T=T, A=A, K=K, us=s * 1e6, gbps=min_bytes / s / 1e9,
                             roofline=min_bytes / s / HBM_ROOFLINE_BPS,
                             blocks=asdict(blocks) if blocks is not None else None))
            r = rows[-1]
            print(f"moe T={T}{tag} {name:<44} {r['us']:8.1f} us  {r['gbps']:7.0f} GB/s  "
                  f"{100 * r['roofline']:5.1f}% of {HBM_ROOFLINE_BPS / 1e12:.1f} TB/s", flush=True)

        add("gathered_expert_ffn (torch)", None, lambda i: gathered_expert_ffn(x, ids[i], weights, w13, w2))
        add("moe_gemv", DEFAULT_GEMV_BLOCKS, lambda i: moe_gemv(x, ids[i], weights, w13, w2))
        if args.sweep:
            b0 = DEFAULT_GEMV_BLOCKS
            variants = [replace(b0, gate_up_block_n=n, gate_up_block_k=k) for n in (4, 8, 16, 32) for k in (256, 512)]
            variants += [replace(b0, down_block_n=n, down_block_k=k) for n in (4, 8, 16, 32) for k in (128, 256)]
            for b in variants:
                if b == b0:
                    continue
                label = (f"gu n{b.gate_up_block_n} k{b.gate_up_block_k} / dn n{b.down_block_n} k{b.down_block_k}")
                try:
                    add(label, b, lambda i, b=b: moe_gemv(x, ids[i], weights, w13, w2, blocks=b))
                except Exception as exc:                              # e.g. out of resources
                    print(f"moe T={T} {label}: failed ({type(exc).__name__}: {exc})"[:200], flush=True)


def small_cases(args, dtype, rows: list[dict]) -> None:
    from ftexpert.gpu_worker.models.layers import apply_rope, rms_norm as torch_rms_norm
    from ftexpert.kernels.moe_decode import add_rms_norm, qk_norm_rope, rms_norm, route_topk
    from ftexpert.kernels.moe_decode.reference import route_topk_reference
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


def linear_variants(picked, K: int, dtype: torch.dtype) -> list:
    """LinearBlocks for --sweep: (block_n, block_k, warps) with the warps along K."""
    from ftexpert.kernels.dense_gemv import LinearBlocks
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    out = []
    for bk, nw in ((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8)):
        if bk < 32 * vec * nw or bk > max(512, 1 << (K - 1).bit_length()):
            continue
        for bn in (1, 2, 4, 8):
            if bn * bk <= 16384:
                out.append(LinearBlocks(block_n=bn, block_k=bk, num_warps=nw))
    seen, unique = {picked}, []
    for b in out:
        if b not in seen:
            seen.add(b)
            unique.append(b)
    return unique


def parse_linear_shapes(text: str) -> list[tuple[str, int, int]]:
    """--linear-shapes "in_qkvz=12288x2048,out=2048x4096" -> [(name, N, K), ...]."""
    shapes = []
    for item in text.split(","):
        name, _, dims = item.strip().partition("=")
        n, _, k = dims.partition("x")
        if not (name and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
            raise SystemExit(f"--linear-shapes: {item!r} is not NAME=NxK (N outputs, K inputs, both > 0)")
        shapes.append((name, int(n), int(k)))
    return shapes


def linear_cases(args, dtype, rows: list[dict]) -> None:
    import torch.nn.functional as F

    from ftexpert.kernels.dense_gemv import MAX_T, linear_gemv, pick_blocks
    H, Hq, Hkv, D, E = args.hidden, args.heads, args.kv_heads, args.head_dim, args.experts
    shapes = ([("qkv", (Hq + 2 * Hkv) * D, H), ("o_proj", H, Hq * D), ("router", E, H)] if not args.linear_shapes
              else parse_linear_shapes(args.linear_shapes))
    gen = torch.Generator(device="cuda").manual_seed(2)
    for short, N, K in shapes:
        name = f"linear {short} {N}x{K}"
        ws = torch.empty(args.calls, N, K, dtype=dtype, device="cuda").normal_(0, 0.02, generator=gen)
        weight_bytes = N * K * ws.element_size()
        picked = pick_blocks(N, K, dtype)
        for T in [int(t) for t in args.tokens.split(",") if t]:
            if T > MAX_T:
                print(f"{name} T={T}: linear_gemv takes at most {MAX_T} rows, skipped", flush=True)
                continue
            x = torch.randn(T, K, device="cuda").to(dtype)
            ref = F.linear(x, ws[0]).float()
            diff = ((linear_gemv(x, ws[0]).float() - ref).abs().max() / ref.abs().max()).item()

            def add(label, blocks, fn):
                s = time_graph(fn, args.calls, args.reps, args.warmup)
                rows.append(dict(kind="linear", name=name, impl=label, T=T, us=s * 1e6,
                                 gbps=weight_bytes / s / 1e9, roofline=weight_bytes / s / HBM_ROOFLINE_BPS,
                                 blocks=asdict(blocks) if blocks is not None else None))
                r = rows[-1]
                print(f"{name} T={T} {label:<34} {r['us']:8.2f} us  {r['gbps']:7.0f} GB/s  "
                      f"{100 * r['roofline']:5.1f}% of {HBM_ROOFLINE_BPS / 1e12:.1f} TB/s", flush=True)

            add("F.linear", None, lambda i: F.linear(x, ws[i]))
            add("linear_gemv", picked, lambda i: linear_gemv(x, ws[i]))
            print(f"{name} T={T} linear_gemv vs F.linear: max |diff| / max |y| = {diff:.2e}", flush=True)
            if args.sweep:
                for b in linear_variants(picked, K, dtype):
                    label = f"gemv n{b.block_n} k{b.block_k} w{b.num_warps}"
                    try:
                        add(label, b, lambda i, b=b: linear_gemv(x, ws[i], blocks=b))
                    except Exception as exc:                          # e.g. out of resources
                        print(f"{name} T={T} {label}: failed ({type(exc).__name__}: {exc})"[:200], flush=True)
        del ws
        torch.cuda.empty_cache()


def _t_label(r: dict) -> str:
    """T, and the routes a token leaves on the GPU where --active set fewer than K."""
    return f"{r['T']}" + (f" (A={r['A']} of {r['K']})" if r.get("A", r.get("K")) != r.get("K") else "")


def print_table(rows: list[dict]) -> None:
    moe = [r for r in rows if r["kind"] == "moe"]
    if moe:
        print("\n| MoE FFN | T | us / call | GB/s | % of 4.8 TB/s |")
        print("|---|---:|---:|---:|---:|")
        best: dict[tuple[int, int], dict] = {}
        for r in moe:
            key = (r["T"], r.get("A", 0))
            if r["name"].startswith("gu "):
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
                continue
            print(f"| {r['name']} | {_t_label(r)} | {r['us']:.1f} | {r['gbps']:.0f} | {100 * r['roofline']:.1f} |")
        for _, r in sorted(best.items()):
            print(f"| best sweep variant: {r['name']} | {_t_label(r)} | {r['us']:.1f} | {r['gbps']:.0f} | "
                  f"{100 * r['roofline']:.1f} |")
    linear = [r for r in rows if r["kind"] == "linear"]
    if linear:
        print("\n| dense projection | T | F.linear us | GB/s | linear_gemv us | GB/s | % of 4.8 TB/s | speedup |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        by_case: dict[tuple[str, int], dict[str, dict]] = {}
        for r in linear:
            by_case.setdefault((r["name"], r["T"]), {})[r["impl"]] = r
        for (name, T), impls in by_case.items():
            base, gemv = impls.get("F.linear"), impls.get("linear_gemv")
            if base is None or gemv is None:
                continue
            print(f"| {name} | {T} | {base['us']:.2f} | {base['gbps']:.0f} | {gemv['us']:.2f} | {gemv['gbps']:.0f} | "
                  f"{100 * gemv['roofline']:.1f} | {base['us'] / gemv['us']:.2f}x |")
        for (name, T), impls in by_case.items():
            sweep = [r for label, r in impls.items() if label.startswith("gemv ")]
            if sweep and "F.linear" in impls:
                r = min(sweep, key=lambda r: r["us"])
                print(f"| {name}, best sweep variant: {r['impl']} | {T} | {impls['F.linear']['us']:.2f} | "
                      f"{impls['F.linear']['gbps']:.0f} | {r['us']:.2f} | {r['gbps']:.0f} | "
                      f"{100 * r['roofline']:.1f} | {impls['F.linear']['us'] / r['us']:.2f}x |")
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
    if not args.linear_only:
        moe_cases(args, dtype, rows)
        torch.cuda.empty_cache()                              # the experts of moe_cases are gone
        if not args.skip_small:
            small_cases(args, dtype, rows)
    if not args.skip_linear:
        linear_cases(args, dtype, rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
