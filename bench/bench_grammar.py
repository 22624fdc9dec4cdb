"""Structured output's cost per token: the grammar mask beside the unconstrained decode step, at batch 1 and 16.

Engine rows (the model given, on the device given): B requests decode together, unconstrained, then constrained by
a JSON schema that cannot end within the run (an array of at least 500 short strings), --rounds runs of each kind
alternated; medians over their --steps decode steps after --warmup each. At B > 1 a further row constrains one
request of the B (does one constrained request slow the others?). Columns: the unconstrained step, the constrained step, and inside the constrained step the
host's mask fill (llguidance, all constrained rows; per token: per constrained row) and the mask's application to the logits (the device's time: CUDA events on
a GPU), each per step and per token. A constrained step also gives up the queue-ahead of the next step
(docs/STRUCTURED_OUTPUT.md), which the step times include.

Mask rows (--tokenizer, repeatable): the fill and the application alone at another vocabulary (e.g. Qwen3's 151,669
tokens, bench/qwen_vocab.py, padded to the model's 151,936 logits with --vocab), on random logits.

    PYTHONPATH=src python bench/bench_grammar.py --device cpu                     # the embedded default model
    PYTHONPATH=src python bench/bench_grammar.py --device cuda --model /models/qwen3-30b-a3b
    PYTHONPATH=src python bench/bench_grammar.py --device cuda --preset qwen3-30b-a3b \
        --grammar-tokenizer /tmp/qwen3-tokenizer/tokenizer.json      # random weights: Qwen3's vocabulary for the masks
    PYTHONPATH=src python bench/bench_grammar.py --device cpu --tokenizer /tmp/qwen3-tokenizer/tokenizer.json --vocab 151936
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR, build_engine
from ftexpert.gpu_worker.engine import Engine, EngineConfig, SamplingParams
from ftexpert.gpu_worker.engine import grammar as grammar_module
from ftexpert.gpu_worker.engine.grammar import GrammarCompiler, GrammarMasks, apply_token_bitmask_
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.grammar_spec import GrammarSpec

ENDLESS = GrammarSpec.json_schema({"type": "array", "minItems": 500,
                                   "items": {"type": "string", "maxLength": 12}})


class Timers:
    """Host time of GrammarMasks.fill and device time of apply_token_bitmask_, per call."""

    def __init__(self, device: torch.device):
        self.device, self.fill_s, self.apply_s, self._events = device, [], [], []
        self._fill, self._apply = GrammarMasks.fill, grammar_module.apply_token_bitmask_

    def __enter__(self) -> "Timers":
        timers = self

        def fill(masks, states):
            t0 = time.perf_counter()
            out = timers._fill(masks, states)
            timers.fill_s.append(time.perf_counter() - t0)
            return out

        def apply(*args, **kwargs):
            if timers.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                timers._apply(*args, **kwargs)
                b.record()
                timers._events.append((a, b))
            else:
                t0 = time.perf_counter()
                timers._apply(*args, **kwargs)
                timers.apply_s.append(time.perf_counter() - t0)

        GrammarMasks.fill, grammar_module.apply_token_bitmask_ = fill, apply
        return self

    def __exit__(self, *exc) -> None:
        GrammarMasks.fill, grammar_module.apply_token_bitmask_ = self._fill, self._apply
        if self._events:
            torch.cuda.synchronize()
            self.apply_s += [a.elapsed_time(b) / 1e3 for a, b in self._events]


def step_times(engine: Engine, batch: int, prompt: list[int], grammar: GrammarSpec | None, warmup: int,
               steps: int, constrained: int | None = None) -> list[float]:
    """Seconds of each decode step (every request decoding) after the warm-up; `grammar` constrains the first
    `constrained` requests (None: all of them)."""
    constrained = batch if constrained is None else constrained
    for i in range(batch):
        engine.add_request(prompt, SamplingParams(max_new_tokens=warmup + steps + 8, ignore_eos=True,
                                                  grammar=grammar if i < constrained else None), request_id=i)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for i in range(batch):
        engine.abort(i)
    engine.step()
    return times[warmup:]


def engine_rows(args) -> list[str]:
    spec = EngineSpec(device=args.device, model=None if args.preset else args.model, preset=args.preset,
                      max_running_requests=max(args.batches), max_context_tokens=args.context)
    built = build_engine(spec)
    engine, device = built.engine, built.device
    if args.grammar_tokenizer:              # a preset's tokenizer is the tiny one: mask at a real vocabulary
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(args.grammar_tokenizer)
        eos = [i for i in (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")) if i is not None]
        engine.grammars = GrammarCompiler.from_tokenizer(tok, engine.model.cfg.vocab_size, eos)
    label = args.preset or os.path.basename(os.path.normpath(args.model))
    prompt = built.source.tokenizer.encode("The list of names in the book:")
    rows = []
    # (batch, constrained rows): every row constrained, and at batch > 1 one constrained row among free ones
    cases = [(b, b) for b in args.batches] + [(b, 1) for b in args.batches if b > 1 and args.one_of]
    for batch, n in cases:
        free, constrained, fills, applies = [], [], [], []
        for _ in range(args.rounds):           # alternated, so that a busy moment of the machine hits both
            free += step_times(engine, batch, prompt, None, args.warmup, args.steps)
            with Timers(device) as timers:
                constrained += step_times(engine, batch, prompt, ENDLESS, args.warmup, args.steps, n)
            fills += timers.fill_s[-args.steps:]
            applies += timers.apply_s[-args.steps:]
        free, constrained = statistics.median(free), statistics.median(constrained)
        fill, apply = statistics.median(fills), statistics.median(applies)
        what = label if n == batch else f"{label}, {n} of {batch} constrained"
        rows.append(f"| {what} | {engine.model.cfg.vocab_size} | {batch} | "
                    f"{free * 1e3:.2f} | {constrained * 1e3:.2f} | {fill * 1e6:.0f} ({fill / n * 1e6:.0f}) | "
                    f"{apply * 1e6:.0f} ({apply / n * 1e6:.1f}) |")
    return rows


def mask_rows(args, path: str) -> list[str]:
    """The fill and the application alone at `path`'s vocabulary, states walked along random allowed tokens."""
    device = torch.device(args.device)
    with open(path) as fh:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_str(fh.read())
    vocab = args.vocab or tok.get_vocab_size()
    eos = [i for i in (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")) if i is not None]
    compiler = GrammarCompiler.from_tokenizer(tok, vocab, eos)
    rows = []
    for batch in args.batches:
        states = [compiler.matcher(ENDLESS) for _ in range(batch)]
        masks = GrammarMasks(batch, vocab, device)
        logits = torch.randn(batch, vocab, device=device)
        gen = torch.Generator().manual_seed(0)
        fills, applies = [], []
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            bitmask = masks.fill(states)
            t1 = time.perf_counter()
            dev = bitmask.to(device, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            apply_token_bitmask_(logits, dev, list(range(batch)), masks.refused)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            if step >= args.warmup:
                fills.append(t1 - t0)
                applies.append(t3 - t2)
            for s, row in zip(states, bitmask):
                bits = torch.nonzero(((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab])
                s.accept(int(bits[torch.randint(len(bits), (1,), generator=gen)]))
            logits.normal_()
        fill, apply = statistics.median(fills), statistics.median(applies)
        rows.append(f"| mask only: {path[-40:]} | {vocab} | {batch} | | | {fill * 1e6:.0f} ({fill / batch * 1e6:.0f}) "
                    f"| {apply * 1e6:.0f} ({apply / batch * 1e6:.1f}) |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="checkpoint directory (default: embedded)")
    ap.add_argument("--preset", default=None, help="random weights of a real shape instead of --model")
    ap.add_argument("--grammar-tokenizer", default=None, help="the engine's masks over this tokenizer.json")
    ap.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps of a run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each kind, alternated")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokenizer", action="append", default=[], help="a tokenizer.json: mask-only rows at its vocab")
    ap.add_argument("--vocab", type=int, default=0, help="mask width of the mask-only rows (0: the tokenizer's)")
    ap.add_argument("--no-engine", action="store_true", help="mask-only rows alone")
    ap.add_argument("--no-one-of", dest="one_of", action="store_false",
                    help="without the rows of one constrained request among B-1 free ones")
    args = ap.parse_args()
    print("| what | vocab | batch | unconstrained step ms | constrained step ms | mask fill us/step (/token) "
          "| mask apply us/step (/token) |")
    print("|---|---|---|---|---|---|---|")
    rows = [] if args.no_engine else engine_rows(args)
    for path in args.tokenizer:
        rows += mask_rows(args, path)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
