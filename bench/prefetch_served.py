"""The served path of the lookahead prefetch: `ft serve` with prefetch off, then on, the same cold prompts through
the official `openai` client, greedy; every answer must be identical (docs/PREFETCH.md).

    python bench/prefetch_served.py                                   # the embedded default model, CPU, offload
    python bench/prefetch_served.py --model DIR --device cuda --moe-cache-size 256 --prompts 60 --max-tokens 256

Each server runs alone (off first, then on, the same flags otherwise); the prompts are windows of held-out documents of
the corpus (cold: no two share their first four words), sent --concurrency at a time (1 by default: a
bfloat16 model's greedy answer can depend on which requests share its batch, docs/SOAK.md, which would hide what
the prefetch does). Prints the mismatches, the prefetch counters of the `on` server from /metrics, and the wall
time of each side; exits 1 on any mismatch or when the `on` server reports no useful prediction.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from ftexpert.coordinator.ports import free_loopback_port  # noqa: E402
from ftexpert.workload.corpus import load_documents, split  # noqa: E402

COUNTER = re.compile(r'^ft_engine_counter_total\{name="(prefetch_[a-z_]+|expert_misses_total|expert_hits_total)"\}\s+(\S+)$')


def cold_prompts(count: int, words: int) -> list[str]:
    """`count` windows of `words` words of held-out documents, no two with the same first four words."""
    _, held = split(load_documents())
    seen, out = set(), []
    for doc in held:
        split_doc = doc.split()
        for start in range(0, len(split_doc) - words + 1, words):   # a long document gives several windows
            prompt = split_doc[start:start + words]
            if " ".join(prompt[:4]) not in seen:
                seen.add(" ".join(prompt[:4]))
                out.append(" ".join(prompt))
            if len(out) == count:
                return out
    raise SystemExit(f"the corpus has only {len(out)} held-out windows of {words} words with distinct prefixes")


class Served:
    """One `ft serve` process on free loopback ports, its output in a log file."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_loopback_port()
        self.log = log
        argv = [sys.executable, "-m", "ftexpert.coordinator.cli", "serve", "--port", str(self.port), "--grpc-port", "-1",
                "--served-model-name", "m", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"ft serve did not become healthy within {timeout_s} s; its log ({self.log}):\n"
                         + self.log.read_text(errors="replace")[-3000:])

    def counters(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as resp:
            text = resp.read().decode()
        return {m.group(1): float(m.group(2)) for m in map(COUNTER.match, text.splitlines()) if m}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self._out.close()
        return code


def answers(server: Served, prompts: list[str], max_tokens: int, concurrency: int) -> list[tuple]:
    import openai

    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=600)

    def one(prompt: str) -> tuple:
        choice = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0]
        return choice.text, choice.finish_reason

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def run_side(mode: str, args, prompts: list[str], log_dir: Path) -> tuple[list[tuple], dict, float]:
    flags = [*(["--model", args.model] if args.model else []), "--device", args.device, "--moe-strategy",
             args.moe_strategy, "--moe-prefetch", mode, "--max-running-requests", str(args.concurrency),
             *(["--moe-cache-size", str(args.moe_cache_size)] if args.moe_cache_size else []),
             *(["--moe-prefetch-budget", str(args.budget)] if mode != "off" else []), *args.serve_arg]
    server = Served(flags, log_dir / f"serve-{mode}.log")
    try:
        server.wait_healthy(args.start_timeout_s)
        t0 = time.perf_counter()
        got = answers(server, prompts, args.max_tokens, args.concurrency)
        wall = time.perf_counter() - t0
        counters = server.counters()
    finally:
        code = server.stop()
    if code != 0:
        raise SystemExit(f"ft serve ({mode}) exited {code}; its log: {server.log}")
    return got, counters, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--moe-strategy", default="offload", choices=("offload", "hybrid"))
    p.add_argument("--moe-cache-size", type=int, default=8, help="GPU expert slots (0: the server's default)")
    p.add_argument("--budget", type=int, default=4, help="--moe-prefetch-budget of the on side")
    p.add_argument("--prompts", type=int, default=60)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a new temporary folder)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `ft serve` argument (repeatable)")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.concurrency < 1:
        p.error("--prompts, --max-tokens and --concurrency must be at least 1")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="prefetch-served-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = cold_prompts(args.prompts, args.prompt_words)
    off, off_counters, off_wall = run_side("off", args, prompts, log_dir)
    on, on_counters, on_wall = run_side("on", args, prompts, log_dir)
    mismatches = [i for i, (a, b) in enumerate(zip(off, on)) if a != b]
    for i in mismatches[:5]:
        print(f"mismatch on prompt {i} {prompts[i][:40]!r}:\n  off: {off[i][0][:120]!r}\n  on:  {on[i][0][:120]!r}")
    useful = on_counters.get("prefetch_useful_total", 0.0)
    first_diff = [next((j for j, (a, b) in enumerate(zip(off[i][0], on[i][0])) if a != b),
                       min(len(off[i][0]), len(on[i][0]))) for i in mismatches]
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "mismatches": len(mismatches),
              "first_diff_chars": sorted(first_diff), "answer_chars_median": sorted(len(a) for a, _ in off)[len(off) // 2],
              "off_wall_s": round(off_wall, 2), "on_wall_s": round(on_wall, 2),
              "off_misses": off_counters.get("expert_misses_total"), "on_misses": on_counters.get("expert_misses_total"),
              "on_prefetch": {k: v for k, v in on_counters.items() if k.startswith("prefetch_")},
              "finish_reasons": sorted({r for _, r in off})}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens: {len(mismatches)} mismatches; misses "
          f"{result['off_misses']} (off) -> {result['on_misses']} (on); useful predictions {useful:.0f}")
    return 1 if mismatches or useful <= 0 else 0


if __name__ == "__main__":
    sys.exit(main())
