"""Micro-benchmark of one layer's prefill attention as the engine runs it for a chunk late in a long context: C new
queries attending, causally aligned to the lower right, over all S positions (the prefix hit's turn: 516 queries on
33,284 positions). The engine's call is SDPA with a lower-right causal bias and grouped-query K/V
(engine/attention.py, `PrefillAttention.attend`, the flash path); beside it the same call under each SDPA backend
that takes it (flash, cuDNN, memory-efficient), so that a chunk whose work spreads over too few thread blocks
(flash's grid is ceil(C / 128) x heads) shows as low TFLOP/s against a long chunk's; and the engine's split of a
short chunk after a long history (engine/prefix_attention.py: history and chunk in two flash calls merged by their
log-sum-exp), with whether the engine takes it for that chunk.

qwen3-30b-a3b heads by default (Hq 32, Hkv 4, D 128, bf16). Each row: median of --reps CUDA-event timings after
--warmup calls; TFLOP/s counts the causal work, 4 x D x Hq x (C x (S - C) + C x (C + 1) / 2). Needs a CUDA GPU.
Usage: python bench/bench_prefill_attention.py [--chunks 516,4096] [--context 33284]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ftexpert.gpu_worker.engine.prefix_attention import prefix_split_attention, split_applies  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", default="516,4096", help="query tokens C of the chunk (comma-separated)")
    p.add_argument("--context", type=int, default=33284, help="positions S the chunk's last query sees")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args(argv)


def causal_flops(C: int, S: int, Hq: int, D: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the positions each query sees: C x (S - C) before the chunk, and the
    chunk's own lower triangle."""
    return 4.0 * D * Hq * (C * (S - C) + C * (C + 1) / 2)


def time_call(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)                       # us
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill_attention.py needs a CUDA GPU (the SDPA backends it compares are CUDA kernels)",
              file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    Hq, Hkv, D, S = args.heads, args.kv_heads, args.head_dim, args.context
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(1, Hkv, S, D, device=dev, dtype=dt, generator=g)
    values = torch.randn(1, Hkv, S, D, device=dev, dtype=dt, generator=g)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  Hq={Hq} Hkv={Hkv} D={D} bf16, context {S}")
    print(f"{'C':>6} {'backend':<10} {'us':>10} {'TFLOP/s':>9}  (engine: flash)")
    for C in [int(c) for c in args.chunks.split(",") if c.strip()]:
        q = torch.randn(1, Hq, C, D, device=dev, dtype=dt, generator=g)
        bias = causal_lower_right(C, S)
        flops = causal_flops(C, S, Hq, D)
        ref = None
        for name, backend in BACKENDS.items():
            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=D ** -0.5,
                                                          enable_gqa=True)
            try:
                out = call()
            except RuntimeError as exc:                             # the backend does not take this call
                print(f"{C:>6} {name:<10} {'-':>10} {'-':>9}  not taken: {str(exc).splitlines()[0][:80]}")
                continue
            if ref is None:
                ref = out
            elif not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                print(f"{C:>6} {name:<10} differs from the first backend's output by "
                      f"{(out.float() - ref.float()).abs().max():.3g}")
            us = time_call(call, args.reps, args.warmup)
            print(f"{C:>6} {name:<10} {us:>10.1f} {flops / us / 1e6:>9.1f}", flush=True)
        # the engine's split for a short chunk after a long history (engine/prefix_attention.py): the history
        # unmasked with the query heads folded, the chunk causally, merged by their log-sum-exp
        if S - C >= 1:
            qc = q[0].transpose(0, 1).contiguous()                                      # [C, Hq, D]

            def split():
                return prefix_split_attention(qc, keys, values, S - C, D ** -0.5)
            out = split()
            applies = split_applies(C, Hq, S - C, dev)
            if ref is not None and not torch.allclose(out.transpose(0, 1).unsqueeze(0).float(), ref.float(),
                                                      atol=2e-2, rtol=2e-2):
                print(f"{C:>6} split      differs from the first backend's output")
            us = time_call(split, args.reps, args.warmup)
            print(f"{C:>6} {'split':<10} {us:>10.1f} {flops / us / 1e6:>9.1f}  (the engine takes it: "
                  f"{'yes' if applies else 'no'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
