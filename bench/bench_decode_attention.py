"""Micro-benchmark of kernels/decode_attention (flash-decoding) against the SDPA path of
`DecodeAttention` it replaces on CUDA, on one GPU.

qwen3-30b-a3b attention shapes (Hq=32, Hkv=4, D=128, bf16), T = 1 and 4 decoding requests, each at
`--contexts` positions (seq_len), attending over the decode bucket the engine would pick for it
(the next power of two, e.g. 1,280 -> 2,048). Rows per case:

- ``sdpa attend`` / ``triton attend``: `DecodeAttention.attend` with backend "sdpa" / "triton" (the
  per-layer cost in a decode step: the K/V write of the new token, then attention);
- ``triton kernel``: `decode_attention` alone (split + merge kernels);
- with ``--sweep``: the kernel under other `DecodeAttentionBlocks`, labelled by their fields: block sizes and
  splits (``--sweep-set blocks``), and the split kernel's software pipelining depth `num_stages`
  (``--sweep-set stages``: ``st=...``, st - for Triton's default), the latter also as a table of its own, last.

Each row captures CALLS calls (48 = layers) in one CUDA graph, call i on layer i of a KV cache of
CALLS layers (so a call does not find its K/V in L2), and times graph replays with CUDA events; the
median per call is reported after warm-up. GB/s counts the K/V bytes a call must read (each
request's seq_len positions of K and V), against the H200's HBM roofline (4.8 TB/s).
The cache is paged as the engine's (`--page`, default 16 positions a block, each request's blocks scattered at
random over the pool); `--page 0` gives every request one contiguous row (a block of the whole bucket).
`--page 0` with the default kernel is the "before paging" baseline (its table is [[0], [1], ...], so the kernel
still reads one page id a tile, of a page of the whole bucket).
Prints a short table last. Usage: python bench/bench_decode_attention.py [--tokens 1,4] [--page 16] [--sweep
[--sweep-set stages]]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from graph_timing import add_graph_timing_args, time_graph  # bench/graph_timing.py (this folder is sys.path[0])

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HBM_ROOFLINE_BPS = 4.8e12          # H200 HBM3e peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,4", help="decoding requests T (comma-separated)")
    p.add_argument("--contexts", default="1024,1280,4096,32768",
                   help="seq_len of every request (comma-separated); the bucket is the next power of two")
    p.add_argument("--max-context", type=int, default=32768, help="caps the bucket (max_context_tokens)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=None, help="sliding window (default: none)")
    p.add_argument("--page", type=int, default=16, help="positions per KV block, scattered blocks (0: one "
                   "contiguous row per request)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    add_graph_timing_args(p)
    p.add_argument("--sweep", action="store_true", help="also time DecodeAttentionBlocks variants")
    p.add_argument("--sweep-set", default="all", choices=["all", "blocks", "stages"],
                   help="which variants --sweep times: block sizes and splits, the split kernel's num_stages "
                        "(stages, STAGES), or both (all); implies --sweep")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA rows")
    p.add_argument("--json-out", default=None, help="write every result here as JSON")
    return p.parse_args(argv)


# the sweep's num_stages (None, Triton's default, 3 on NVIDIA, is the default kernel; 3 re-times it: a noise check)
STAGES = (1, 2, 3, 4, 5)


def sweep_variants(b0, sets: str = "all"):
    """The DecodeAttentionBlocks --sweep times besides b0 (the default), in order, without duplicates."""
    out = []
    if sets in ("all", "blocks"):
        out += [replace(b0, block_n=n, min_chunk=c, short_min_chunk=c) for n in (32, 64, 128)
                for c in (64, 128, 256, 512) if c >= n]
        out += [replace(b0, target_programs=p) for p in (128, 512, 1024)]
        out += [replace(b0, num_warps=w) for w in (2, 8)]
    if sets in ("all", "stages"):
        out += [replace(b0, num_stages=st) for st in STAGES]
    return [b for i, b in enumerate(out) if b != b0 and b not in out[:i]]


def variant_label(b, splits: int, chunk: int) -> str:
    return (f"n{b.block_n} chunk>={b.min_chunk} P{b.target_programs} w{b.num_warps} "
            f"st={'-' if b.num_stages is None else b.num_stages} ({splits}x{chunk})")


def run_case(args, dtype, T: int, ctx: int, rows: list[dict], device: str = "cuda", timer=time_graph) -> None:
    from ftexpert.gpu_worker.engine.attention import DecodeAttention, decode_bucket_tokens
    from ftexpert.gpu_worker.engine.kv_cache import KVCache
    from ftexpert.gpu_worker.checkpoint.config import MoeConfig
    from ftexpert.kernels.decode_attention import DEFAULT_BLOCKS, decode_attention, split_plan
    Hq, Hkv, D, L = args.heads, args.kv_heads, args.head_dim, args.calls
    bucket = decode_bucket_tokens(ctx, args.max_context)
    cfg = MoeConfig(arch="qwen3", vocab_size=8, hidden_size=Hq * D, num_layers=L, num_heads=Hq,
                    num_kv_heads=Hkv, head_dim=D, num_experts=2, top_k=1, expert_intermediate_size=8,
                    rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=args.max_context)
    if args.page:                                                  # [L, T * bucket / page, page, Hkv, D]
        per_row = -(-bucket // args.page)
        kv = KVCache(cfg, T, bucket, dtype, torch.device(device), block_size=args.page, num_blocks=T * per_row)
        blocks = torch.randperm(T * per_row).tolist()              # every request's blocks scattered
        for slot in range(T):
            kv.set_row(slot, blocks[slot * per_row:(slot + 1) * per_row])
        kv.sync()
    else:
        kv = KVCache(cfg, T, bucket, dtype, torch.device(device))  # [L, T, bucket, Hkv, D]: one row each
    kv.k.normal_()
    kv.v.normal_()
    slots = torch.arange(T, device=device)
    positions = torch.full((T,), ctx - 1, dtype=torch.int64, device=device)
    q = torch.randn(T, Hq, D, device=device).to(dtype)
    k_new = torch.randn(T, Hkv, D, device=device).to(dtype)
    v_new = torch.randn(T, Hkv, D, device=device).to(dtype)
    kv_bytes = T * min(ctx, args.window or ctx) * Hkv * D * 2 * kv.k.element_size()
    splits, chunk = split_plan(bucket, T, Hkv)

    def add(name, fn, blocks=None):
        try:
            s = timer(fn, L, args.reps, args.warmup)
        except Exception as exc:                                   # e.g. out of resources
            print(f"T={T} ctx={ctx} {name}: failed ({type(exc).__name__}: {exc})"[:240], flush=True)
            return
        rows.append(dict(name=name, T=T, ctx=ctx, bucket=bucket, page=args.page, us=s * 1e6,
                         gbps=kv_bytes / s / 1e9, roofline=kv_bytes / s / HBM_ROOFLINE_BPS,
                         blocks=asdict(blocks) if blocks is not None else None))
        r = rows[-1]
        print(f"T={T} ctx={ctx:>6} bucket={bucket:>6} {name:<68} {r['us']:8.1f} us  {r['gbps']:7.0f} GB/s  "
              f"{100 * r['roofline']:5.1f}% of {HBM_ROOFLINE_BPS / 1e12:.1f} TB/s", flush=True)

    attns = {b: DecodeAttention(kv, slots, positions, bucket, args.window, backend=b)
             for b in ("sdpa", "triton")}
    if not args.no_sdpa:
        add("sdpa attend", lambda i: attns["sdpa"].attend(i, q, k_new, v_new))
    add("triton attend", lambda i: attns["triton"].attend(i, q, k_new, v_new))
    seq_lens = positions + 1
    scale = D ** -0.5

    def kernel(blocks):
        return lambda i: decode_attention(q, kv.k[i], kv.v[i], slots, seq_lens, scale=scale, bucket=bucket,
                                          sliding_window=args.window, blocks=blocks, block_tables=kv.block_tables)

    add(f"triton kernel ({splits} splits x {chunk})", kernel(DEFAULT_BLOCKS), DEFAULT_BLOCKS)
    if args.sweep:
        for b in sweep_variants(DEFAULT_BLOCKS, args.sweep_set):
            add(variant_label(b, *split_plan(bucket, T, Hkv, b)), kernel(b), b)


def print_table(rows: list[dict], sweep: bool) -> None:
    """The short table: one line per (T, context)."""
    print("\n   T    ctx  bucket   sdpa us  triton attend us  kernel us  speedup  kernel GB/s  % roofline")
    for T in sorted({r["T"] for r in rows}):
        for ctx in sorted({r["ctx"] for r in rows if r["T"] == T}):
            case = [r for r in rows if r["T"] == T and r["ctx"] == ctx]
            get = {r["name"].split(" (")[0]: r for r in case}
            sd, ta, ke = get.get("sdpa attend"), get.get("triton attend"), get.get("triton kernel")
            if ke is None:
                continue
            best = min((r for r in case if r["blocks"] is not None), key=lambda r: r["us"])
            speed = f"{sd['us'] / ta['us']:7.1f}x" if sd and ta else "      -"
            print(f"{T:>4} {ctx:>6} {ke['bucket']:>7} {sd['us'] if sd else float('nan'):>9.1f} "
                  f"{ta['us'] if ta else float('nan'):>17.1f} {ke['us']:>10.1f} {speed} {ke['gbps']:>12.0f} "
                  f"{100 * ke['roofline']:>10.1f}" + (f"   (best sweep: {best['us']:.1f} us {best['name']})"
                                                      if sweep and best is not ke else ""))


def print_stages_table(rows: list[dict]) -> None:
    """The num_stages rows (the default block sizes otherwise) of each (T, context): us a call; the default kernel
    is st=-; * marks each case's fastest."""
    from ftexpert.kernels.decode_attention import DEFAULT_BLOCKS
    base = {k: v for k, v in asdict(DEFAULT_BLOCKS).items() if k != "num_stages"}
    mine = [r for r in rows if r["blocks"] is not None
            and {k: v for k, v in r["blocks"].items() if k != "num_stages"} == base]
    stages = sorted({r["blocks"]["num_stages"] for r in mine}, key=lambda st: -1 if st is None else st)
    if len(mine) < 2:
        return
    print(f"\nsplit kernel num_stages, us a call (page {rows[0]['page']}; default: st=-; * fastest)")
    print("   T    ctx " + "".join(f"{'st=' + ('-' if st is None else str(st)):>9}" for st in stages))
    for T in sorted({r["T"] for r in mine}):
        for ctx in sorted({r["ctx"] for r in mine if r["T"] == T}):
            case = {r["blocks"]["num_stages"]: r["us"] for r in mine if r["T"] == T and r["ctx"] == ctx}
            best = min(case.values())
            cells = "".join(f"{case[st]:8.2f}{'*' if case[st] == best else ' '}" if st in case else f"{'':>9}"
                            for st in stages)
            print(f"{T:>4} {ctx:>6} {cells}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep_set != "all":
        args.sweep = True
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    import triton
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}  {args.calls} calls per graph",
          flush=True)
    rows: list[dict] = []
    for T in [int(t) for t in args.tokens.split(",") if t]:
        for ctx in [int(c) for c in args.contexts.split(",") if c]:
            run_case(args, dtype, T, ctx, rows)
            torch.cuda.empty_cache()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    print_table(rows, args.sweep)
    print_stages_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
