"""Held-out loss per expert format: what each `--expert-format` costs in quality, on a trained checkpoint.

    python bench/bench_format_quality.py                                  # the embedded trained default model
    python bench/bench_format_quality.py --model DIR --formats bf16,fp8,int4,nvfp4 --tokens 16384 --device cuda

The checkpoint is loaded by the service's own loader once per format (the experts quantized at load, round to
nearest, and computed by the service's kernels for that format: the same path `ft serve --expert-format F`
takes), then every held-out window of the bundled corpus (workload.routing.held_out_sequences, the text the
trained models never saw) is run through `MoeModel.forward` with causal attention; the loss is the mean
next-token cross-entropy in nats. One table: the loss, its increase over bf16, and perplexity.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR, load_model  # noqa: E402
from ftexpert.workload.routing import WINDOW, held_out_sequences  # noqa: E402


class CausalAttention:
    """One sequence, all its positions at once: causal attention over its own k / v (grouped-query heads)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               kv_written: bool = False) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True)
        return out.transpose(0, 1)

    def kv_write(self, layer_idx: int, v: torch.Tensor) -> None:
        return None


@torch.inference_mode()
def held_out_loss(model_dir: str, fmt: str, seqs: list[list[int]], device: str) -> float:
    loaded = load_model(model_dir, device=device, expert_format=fmt, fused_kernels=False)
    model, dev = loaded.model, loaded.device
    total, count = 0.0, 0
    for ids in seqs:
        x = torch.tensor(ids, dtype=torch.int64, device=dev)
        logits = model.forward(x[:-1], torch.arange(len(ids) - 1, device=dev), CausalAttention())
        total += F.cross_entropy(logits, x[1:], reduction="sum").item()
        count += len(ids) - 1
    return total / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="a trained checkpoint (default: embedded)")
    parser.add_argument("--formats", default="bf16,fp8,int4,mxfp4,nvfp4")
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    seqs = held_out_sequences(tok, args.tokens, WINDOW)
    n = sum(len(s) - 1 for s in seqs)
    print(f"{args.model}: {n} held-out next-token predictions in {len(seqs)} windows, device {args.device}")
    rows = []
    for fmt in args.formats.split(","):
        t0 = time.perf_counter()
        loss = held_out_loss(args.model, fmt, seqs, args.device)
        rows.append((fmt, loss))
        print(f"  {fmt}: loss {loss:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    base = dict(rows).get("bf16")
    print("\n| format | held-out loss (nats / token) | over bf16 | perplexity |\n|---|---:|---:|---:|")
    for fmt, loss in rows:
        delta = f"{loss - base:+.4f}" if base is not None else ""
        print(f"| {fmt} | {loss:.4f} | {delta} | {math.exp(loss):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
