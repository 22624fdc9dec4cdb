"""Train a MoE language model from scratch and write it as a Hugging Face checkpoint.

    python -m ftexpert.workload.train_moe --shape tiny --out DIR [--tokens N | --minutes M]
                                 [--device cuda|cpu] [--seed S] [--corpus PATH]

Objective: next-token cross-entropy + ``router_aux_loss_coef`` * transformers' load-balancing loss.
Deterministic for a seed with ``--tokens`` (on the CPU bit for bit; on CUDA as far as its kernels
are). ``--minutes`` times the first steps and then fixes the step count (printed, with the
``--tokens`` that reproduces it). bf16 autocast on CUDA; experts through ``torch._grouped_mm``
where torch has it, else a loop over experts. Prints a progress bar with the loss, tokens/s, model
FLOP utilisation (CUDA) and ETA.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from ftexpert.workload import corpus
from ftexpert.workload.checkpoint import write_checkpoint
from ftexpert.workload.curve import Curve, curve_steps
from ftexpert.workload.model import MoeLM, grouped_mm_available, load_balancing_loss, lm_loss, train_flops_per_token
from ftexpert.workload.shapes import SHAPES, Shape
from ftexpert.workload.tokenizer import train_tokenizer
from ftexpert.workload.train_args import add_arguments, check

WARM_STEPS = 3              # --minutes: steps before the timing starts (compilation, allocator warm-up)
TIMING_STEPS = 8            # --minutes: steps timed before the step count is fixed
LOG_EVERY = 10              # steps between progress updates (every step before that)
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def encode_stream(tok, docs: list[str]) -> torch.Tensor:
    """Documents joined by <|endoftext|> into one token stream."""
    sep = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, total: int, shape: Shape) -> float:
    """Linear warmup over ``shape.warmup_steps``, then cosine to 10% at ``total``."""
    if step < shape.warmup_steps:
        return shape.lr * (step + 1) / shape.warmup_steps
    frac = (step - shape.warmup_steps) / max(1, total - shape.warmup_steps)
    return shape.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


class Progress:
    """One status line, redrawn in place on a terminal, every ~10% otherwise."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = -1.0

    def update(self, step: int, total: int, text: str) -> None:
        frac = step / total
        if not self.tty and step != total and frac - self.last < 0.1:
            return
        self.last = frac
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        head = "\r" if self.tty else ""
        end = "" if self.tty and step != total else "\n"
        self.stream.write(f"{head}[{bar}] {step}/{total} {text}{end}")
        self.stream.flush()


def fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def train(shape: Shape, out: Path, tokens: int | None, minutes: float | None, device: str,
          seed: int, corpus_path: str | None, log=print, curve_points: int = 0, compile: bool = True) -> Path:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new --out directory")
    dev = torch.device(device)
    if dev.type == "cuda":      # deterministic cuBLAS and index backward, where CUDA has them
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    threads = torch.get_num_threads()
    if dev.type == "cpu":       # small ops: a second thread's synchronisation costs more than it saves
        torch.set_num_threads(1)
    try:
        return _train(shape, out, tokens, minutes, dev, seed, corpus_path, log, curve_points,
                      compile and dev.type == "cuda")
    finally:
        torch.set_num_threads(threads)


def _train(shape: Shape, out: Path, tokens: int | None, minutes: float | None, dev: torch.device,
           seed: int, corpus_path: str | None, log, curve_points: int, compile: bool) -> Path:
    torch.manual_seed(seed)
    docs = corpus.load_documents(corpus_path)
    train_docs, held = corpus.split(docs)
    if shape.corpus_docs:                                  # the chat exchanges are at the end: keep them
        chats = len(corpus.CHATS) * corpus.CHAT_REPEAT
        train_docs = train_docs[:shape.corpus_docs] + train_docs[-chats:]
    tok_docs = train_docs if not shape.tokenizer_docs else train_docs[:shape.tokenizer_docs]
    tok_docs = tok_docs + [corpus.chat_text(u, a) for u, a in corpus.CHATS]
    tok = train_tokenizer(tok_docs, shape.vocab_size)
    stream = encode_stream(tok, train_docs)
    log(f"corpus: {len(train_docs)} training documents, {stream.numel():,} tokens; "
        f"{len(held)} held out; vocabulary {tok.get_vocab_size()}")
    cfg = shape.model_config()
    if tok.get_vocab_size() != cfg.vocab_size:            # a corpus too small for the vocabulary
        cfg = type(cfg)(**{**cfg.to_dict(), "vocab_size": tok.get_vocab_size()})
    model = MoeLM(cfg, "grouped" if grouped_mm_available(dev) else "loop")
    model.init_weights(seed)
    model.to(dev).train()
    if compile:
        model.compile_layers()
    step_tokens = shape.batch_size * shape.seq_len
    total = max(1, (tokens if tokens is not None else shape.tokens) // step_tokens)
    if minutes is not None:
        total = max(WARM_STEPS + TIMING_STEPS + 1, shape.warmup_steps + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    flops_tok = train_flops_per_token(cfg, shape.seq_len)
    peak = peak_flops(dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None
    log(f"shape {shape.name}: {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.top_k}, "
        f"hidden {cfg.hidden_size}; {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"experts {model.experts_impl}{', compiled layers' if compile else ''}; {step_tokens} tokens a step "
        f"on {dev}")
    curve = Curve(tok, shape.seq_len, curve_points, log)
    marks = curve_steps(total, curve_points) if minutes is None else set()
    held_loss_now = lambda: evaluate(model, tok, held, shape, dev, autocast, max_windows=8)  # noqa: E731
    if curve_points:
        curve.record(model, 0, 0, held_loss_now)
        curve.seconds = 0.0                       # (before the clock starts)
    progress = Progress()
    start = time.perf_counter()
    loss_avg = None
    step, warm_at = 0, 0.0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, shape)
        starts = torch.randint(0, stream.numel() - shape.seq_len - 1, (shape.batch_size,), generator=gen)
        batch = torch.stack([stream[s:s + shape.seq_len + 1] for s in starts.tolist()]).to(dev)
        if autocast is not None:
            with autocast:
                logits, router_logits, _ = model(batch[:, :-1])
        else:
            logits, router_logits, _ = model(batch[:, :-1])
        ce = lm_loss(logits, batch[:, 1:])
        aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.top_k)
        loss = ce + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step in marks and step > 0:
            curve.record(model, step, step * step_tokens, held_loss_now)
        timing = step in (WARM_STEPS, WARM_STEPS + TIMING_STEPS)
        if step > LOG_EVERY and step % LOG_EVERY and step != total and not timing:
            continue                              # reading the loss waits for the GPU: not every step
        ce_val = ce.item()
        loss_avg = ce_val if loss_avg is None else 0.8 * loss_avg + 0.2 * ce_val
        elapsed = time.perf_counter() - start - curve.seconds
        if step == WARM_STEPS:
            warm_at = elapsed
        if minutes is not None and step == WARM_STEPS + TIMING_STEPS:
            per_step = (elapsed - warm_at) / TIMING_STEPS
            total = max(total, step + int((minutes * 60 - elapsed) / per_step))
            marks = curve_steps(total, curve_points)
            log(f"--minutes {minutes}: {total} steps (--tokens {total * step_tokens} reproduces it)")
        tok_s = step * step_tokens / elapsed
        mfu = f" MFU {100 * tok_s * flops_tok / peak:.1f}%" if peak else ""
        progress.update(step, total, f"loss {loss_avg:.3f} aux {aux.item():.3f} "
                                     f"{tok_s:,.0f} tok/s{mfu} ETA {fmt_eta(elapsed / step * (total - step))}")
    elapsed = time.perf_counter() - start - curve.seconds
    held_loss = evaluate(model, tok, held, shape, dev, autocast)
    log(f"trained {step} steps, {step * step_tokens:,} tokens in {elapsed:.1f}s "
        f"({step * step_tokens / elapsed:,.0f} tok/s); held-out loss {held_loss:.3f}")
    meta = {"shape": shape.name, "seed": seed, "steps": step, "tokens": step * step_tokens,
            "corpus": str(corpus_path or corpus.KJV_PATH.name), "held_out_loss": round(held_loss, 4),
            "held_out_every": corpus.HELD_OUT_EVERY, "train_seconds": round(elapsed, 1),
            "tokens_per_s": round(step * step_tokens / elapsed)}
    if curve.rows:
        meta["curve"] = curve.rows
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    path = write_checkpoint(out, model.cpu().eval(), tok, dtype, meta)
    log(f"wrote {path}")
    return path


@torch.no_grad()
def evaluate(model: MoeLM, tok, held: list[str], shape: Shape, dev, autocast,
             max_windows: int = 32) -> float:
    """Mean next-token loss on up to ``max_windows`` held-out windows of ``seq_len`` tokens (eagerly:
    compiling an inference graph for a few windows would cost more than it saves)."""
    with torch.compiler.set_stance("force_eager"):
        return _evaluate(model, tok, held, shape, dev, autocast, max_windows)


def _evaluate(model: MoeLM, tok, held: list[str], shape: Shape, dev, autocast, max_windows: int) -> float:
    model.eval()
    stream = encode_stream(tok, held)
    n = min(max_windows, (stream.numel() - 1) // shape.seq_len)
    losses = []
    for i in range(n):
        chunk = stream[i * shape.seq_len:(i + 1) * shape.seq_len + 1].to(dev)[None]
        if autocast is not None:
            with autocast:
                logits = model(chunk[:, :-1])[0]
        else:
            logits = model(chunk[:, :-1])[0]
        losses.append(float(lm_loss(logits, chunk[:, 1:])))
    model.train()
    return sum(losses) / max(1, len(losses))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train-moe", description="Train a MoE LM and write a Hugging "
                                "Face Qwen3MoeForCausalLM checkpoint.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train(SHAPES[args.shape], args.out, args.tokens, args.minutes, args.device, args.seed, args.corpus,
          curve_points=args.curve_points, compile=not args.no_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
