"""Micro-benchmark of the decode MoE FFN over quantized slots (kernels/moe_decode/quant.py) beside bf16 moe_gemv.

qwen3-30b-a3b shapes (E=128 slots, H=2048, I=768, K=8), T = 1 and 4 tokens, for each format: `moe_gemv_quant`
reading E slot rows of proto.expert_format bytes, and `moe_gemv` over bf16 experts. Timing as
bench_moe_decode.py: CALLS calls in one CUDA graph, each with its own random routes (so that consecutive
calls do not find their experts in L2, which holds ~8 4-bit experts' routes of several calls: repeating one
call, as triton.testing.do_bench does, would time L2 reads), the median per call of REPS replays. GB/s
counts the bytes a call must read at least: its distinct routed experts in the format's bytes (codes,
scales, zero points), against the H200's HBM roofline (4.8 TB/s). Then `dequantize_rows` of all E slots into
a bf16 scratch (the prefill's way to the grouped GEMMs): GB/s of bytes read plus written.
`--sweep` also times GemvBlocks variants per format. Usage:
    python bench/bench_moe_decode_quant.py [--formats fp8,int4,mxfp4,nvfp4] [--tokens 1,4] [--sweep]
    python bench/bench_moe_decode_quant.py --dry-run      (the cases, without a GPU)
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
DISTINCT_EXPERTS = 8               # experts quantized; the E slots repeat their bytes (distinct addresses)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="fp8,int4,int4-g32,mxfp4,nvfp4",
                   help="expert formats (proto.expert_format.ExpertFormat.parse), comma-separated; bf16 runs beside")
    p.add_argument("--tokens", default="1,4", help="decode batch sizes T (comma-separated)")
    p.add_argument("--experts", type=int, default=128, help="slot rows E")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="expert intermediate size I")
    p.add_argument("--top-k", type=int, default=8)
    add_graph_timing_args(p)
    p.add_argument("--sweep", action="store_true", help="also time GemvBlocks variants of moe_gemv_quant")
    p.add_argument("--mma-sweep", action="store_true",
                   help="also time the tensor-core gate/up (GemvBlocks.quant_mma; mxfp4, nvfp4) beside the defaults")
    p.add_argument("--skip-dequant", action="store_true", help="no dequantize_rows row")
    p.add_argument("--dry-run", action="store_true", help="list the cases and layouts, run nothing (no GPU needed)")
    p.add_argument("--json-out", default=None, help="write every result here as JSON")
    return p.parse_args(argv)


def block_variants(b0):
    # 4-bit codes are a quarter of bf16's bytes a column, so longer K steps keep as many bytes in flight
    gu = [(n, k) for n in (2, 4, 8, 16) for k in (256, 512, 1024)] + [(1, 1024), (1, 2048), (2, 2048)]
    dn = [(n, k) for n in (8, 16, 32) for k in (128, 256, 512)] + [(4, 1024), (8, 1024), (16, 1024)]
    out = [replace(b0, gate_up_block_n=n, gate_up_block_k=k) for n, k in gu]
    out += [replace(b0, down_block_n=n, down_block_k=k) for n, k in dn]
    # the best gate/up and down of the H100 sweeps together (mxfp4 at gpt-oss-120b's shape, nvfp4 at qwen3-next's)
    both = replace(b0, gate_up_block_n=8, down_block_n=8)
    out.append(both)
    # a scale a group's sum instead of a weight (GemvBlocks.quant_group_sum; the 4-bit formats, else the same)
    out += [replace(b, quant_group_sum=True) for b in (b0, replace(b0, gate_up_block_n=8),
                                                        replace(b0, down_block_n=8), both,
                                                        replace(b0, gate_up_block_k=1024, down_block_k=512))]
    return [b for b in out if b != b0]


def mma_variants(b0, group: int):
    """The tensor-core GEMVs (quant_mma, quant_mma_down) on the format's defaults: gate/up with 32 or 64 rows a
    program, K steps of 16 or 32 groups, the automatic ranges or one, 4 or 8 warps; down with 64 or 128 rows, 16
    groups a step, 4 or 8 warps; and both together."""
    gu = [replace(b0, quant_mma=True, gate_up_block_n=n, gate_up_block_k=k * group, mma_split=s, mma_warps=w)
          for n in (32, 64) for k in (16, 32) for s in (0, 1) for w in (4, 8)]
    dn = [replace(b0, quant_mma_down=True, down_block_n=n, down_block_k=16 * group, mma_warps=w)
          for n in (64, 128) for w in (4, 8)]
    both = [replace(b0, quant_mma=True, quant_mma_down=True, gate_up_block_n=64, gate_up_block_k=16 * group,
                    down_block_n=128, down_block_k=16 * group, mma_warps=w) for w in (4, 8)]
    return gu + dn + both


def variant_name(b) -> str:
    return (f"gu n{b.gate_up_block_n} k{b.gate_up_block_k} / dn n{b.down_block_n} k{b.down_block_k}"
            + (" gsum" if b.quant_group_sum else "")
            + (" mma" if b.quant_mma else "") + (" mma-down" if b.quant_mma_down else "")
            + (f" split {b.mma_split or 'auto'} w{b.mma_warps}" if b.quant_mma or b.quant_mma_down else ""))


def quantized_rows(layout, E: int, gen: torch.Generator) -> torch.Tensor:
    """[E, expert_nbytes] uint8 on the GPU: DISTINCT_EXPERTS random experts quantized, repeated over E slots."""
    from ftexpert.kernels.expert_reference import quantize_expert
    H, I = layout.hidden_size, layout.intermediate_size
    rows = torch.empty(E, layout.expert_nbytes, dtype=torch.uint8, device="cuda")
    for e in range(min(E, DISTINCT_EXPERTS)):
        gate, up, down = (torch.empty(r, c, device="cuda").normal_(0, 0.02, generator=gen)
                          for r, c in ((I, H), (I, H), (H, I)))
        quantize_expert(gate, up, down, layout.fmt, out=rows[e])
    for e in range(DISTINCT_EXPERTS, E):
        rows[e].copy_(rows[e % DISTINCT_EXPERTS])
    return rows


def cases(args) -> list[tuple[str, int]]:
    return [(f, int(t)) for f in ["bf16"] + [s.strip() for s in args.formats.split(",") if s.strip()]
            for t in args.tokens.split(",") if t.strip()]


def run(args, rows_out: list[dict]) -> None:
    from ftexpert.kernels.moe_decode import DEFAULT_GEMV_BLOCKS, moe_gemv
    from ftexpert.kernels.moe_decode.api import QUANT_GEMV_BLOCKS
    from ftexpert.kernels.moe_decode.quant import dequantize_rows, moe_gemv_quant
    from ftexpert.proto.expert_format import ExpertFormat, QuantLayout
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(1)
    by_format: dict[str, tuple] = {}
    for label, T in cases(args):
        if label not in by_format:
            torch.cuda.empty_cache()
            if label == "bf16":
                w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
                w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02, generator=gen)
                by_format = {label: ((w13, w2), 3 * H * I * 2)}
            else:
                layout = QuantLayout(H, I, ExpertFormat.parse(label))
                by_format = {label: ((quantized_rows(layout, E, gen), layout), layout.expert_nbytes)}
        operands, expert_bytes = by_format[label]
        ids = [torch.stack([torch.randperm(E, generator=cpu_gen)[:K] for _ in range(T)]).cuda()
               for _ in range(args.calls)]                                # [T, K] per call
        weights = torch.softmax(torch.randn(T, K, device="cuda"), -1)
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        min_bytes = statistics.mean(int(torch.unique(i).numel()) for i in ids) * expert_bytes

        def add(name, blocks, fn):
            s = time_graph(fn, args.calls, args.reps, args.warmup)
            rows_out.append(dict(kind="moe", format=label, name=name, T=T, K=K, us=s * 1e6, gbps=min_bytes / s / 1e9,
                                 roofline=min_bytes / s / HBM_ROOFLINE_BPS, expert_bytes=expert_bytes,
                                 blocks=asdict(blocks) if blocks is not None else None))
            r = rows_out[-1]
            print(f"{label:<10} T={T} {name:<40} {r['us']:8.1f} us  {r['gbps']:7.0f} GB/s  "
                  f"{100 * r['roofline']:5.1f}% of {HBM_ROOFLINE_BPS / 1e12:.1f} TB/s", flush=True)

        if label == "bf16":
            w13, w2 = operands
            add("moe_gemv", DEFAULT_GEMV_BLOCKS, lambda i: moe_gemv(x, ids[i], weights, w13, w2))
            continue
        slots, layout = operands
        add("moe_gemv_quant", DEFAULT_GEMV_BLOCKS, lambda i: moe_gemv_quant(x, ids[i], weights, slots, layout))
        variants = []
        if args.sweep:              # (the group sum is the same kernel as without for fp8)
            variants += [b for b in block_variants(DEFAULT_GEMV_BLOCKS) if not (b.quant_group_sum and label == "fp8")]
        if args.mma_sweep and label in QUANT_GEMV_BLOCKS:
            variants += mma_variants(QUANT_GEMV_BLOCKS[label], layout.fmt.group_size)
        for b in variants:
            tag = variant_name(b)
            try:
                add(tag, b, lambda i, b=b: moe_gemv_quant(x, ids[i], weights, slots, layout, blocks=b))
            except Exception as exc:                                  # e.g. out of resources
                print(f"{label} T={T} {tag}: failed ({type(exc).__name__}: {exc})"[:200], flush=True)
        if not args.skip_dequant and T == int(args.tokens.split(",")[0]):
            all_ids = torch.arange(E, device="cuda")
            scratch = torch.empty(E, 3 * H * I, dtype=torch.bfloat16, device="cuda")
            moved = E * (layout.expert_nbytes + 3 * H * I * 2)
            s = time_graph(lambda i: dequantize_rows(slots, all_ids, layout, torch.bfloat16, out=scratch), 1,
                           args.reps, args.warmup)
            rows_out.append(dict(kind="dequant", format=label, E=E, us=s * 1e6, gbps=moved / s / 1e9,
                                 roofline=moved / s / HBM_ROOFLINE_BPS))
            print(f"{label:<10} dequantize_rows of {E} slots -> bf16  {s * 1e6:9.1f} us  {moved / s / 1e9:7.0f} GB/s "
                  f"(read + written)  {100 * moved / s / HBM_ROOFLINE_BPS:5.1f}%", flush=True)
            del scratch


def print_table(rows: list[dict]) -> None:
    moe = [r for r in rows if r["kind"] == "moe" and not r["name"].startswith("gu ")]
    if moe:
        bf16 = {r["T"]: r for r in moe if r["format"] == "bf16"}
        print("\n| format | bytes / expert | T | us / call | GB/s | % of 4.8 TB/s | speed-up over bf16 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in moe:
            base = bf16.get(r["T"])
            up = f"{base['us'] / r['us']:.2f}x" if base else "-"
            print(f"| {r['format']} {r['name']} | {r['expert_bytes'] / 1e6:.2f} MB | {r['T']} | {r['us']:.1f} | "
                  f"{r['gbps']:.0f} | {100 * r['roofline']:.1f} | {up} |")
    sweep = [r for r in rows if r["kind"] == "moe" and r["name"].startswith("gu ")]
    best: dict[tuple[str, int], dict] = {}
    for r in sweep:
        key = (r["format"], r["T"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for (fmt, T), r in sorted(best.items()):
        print(f"| {fmt} best sweep variant: {r['name']} | | {T} | {r['us']:.1f} | {r['gbps']:.0f} | "
              f"{100 * r['roofline']:.1f} | |")
    dq = [r for r in rows if r["kind"] == "dequant"]
    if dq:
        print("\n| dequantize_rows -> bf16 | slots | us | GB/s read + written | % of 4.8 TB/s |")
        print("|---|---:|---:|---:|---:|")
        for r in dq:
            print(f"| {r['format']} | {r['E']} | {r['us']:.1f} | {r['gbps']:.0f} | {100 * r['roofline']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ftexpert.proto.expert_format import ExpertFormat, QuantLayout
    for label, T in cases(args):                         # bad formats / shapes fail here, before any GPU work
        if label != "bf16":
            QuantLayout(args.hidden, args.inter, ExpertFormat.parse(label))
    if args.dry_run:
        for label, T in cases(args):
            nbytes = (3 * args.hidden * args.inter * 2 if label == "bf16"
                      else QuantLayout(args.hidden, args.inter, ExpertFormat.parse(label)).expert_nbytes)
            print(f"{label:<10} T={T} K={args.top_k} E={args.experts}: {nbytes} bytes / expert")
        return 0
    if not torch.cuda.is_available():
        print("bench_moe_decode_quant needs a CUDA GPU (--dry-run lists the cases)", file=sys.stderr)
        return 2
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16 activations, "
          f"E={args.experts} H={args.hidden} I={args.inter} K={args.top_k}, {args.calls} calls a graph, "
          f"median of {args.reps} replays", flush=True)
    rows: list[dict] = []
    run(args, rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
