"""`ft soak`: a live `ft serve` on 127.0.0.1 under a bounded mix of concurrent requests, with faults.

    ft soak                                                  # 60 s, process mode, the tiny model on this machine
    ft soak --duration-s 20 --kill-gpu-worker-at-s 8         # the CI run (tests/bench/test_soak.py)
    ft soak --duration-s 150 --serve-args "--device cpu --moe-strategy hybrid --num-cpu-workers 1" \\
        --kill-cpu-worker-at-s 40 --kill-gpu-worker-at-s 90 --out docs/soak/2026-12-01-cpu-hybrid

Clients (threads, each with its own seeded generator) loop until the deadline over: greedy completions
(checked against a reference taken before the load, so batching must not change greedy tokens), greedy
streams, chats, seeded sampled completions (the same seed must give the same text), bad requests (each must
be a 4xx JSON error), clients that disconnect mid-stream, and agent-like conversations (a shared system prompt,
histories growing turn by turn, every reply checked; the prefix cache must serve their histories). Faults: SIGKILL of the GPU worker and of a CPU
worker on a schedule. Checks: answers, errors (503s count as the outage of a GPU-worker kill only), requests
left inside, KV blocks held after the load, the prefix cache's hit share, growth of memory, open files, threads
and shared memory, recovery, a clean SIGTERM stop, no /dev/shm segment left. The report folder (--out) gets report.json, report.png and server.log. Exit code 0
when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

from ftexpert.proto.cli_flags import add_workers_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration-s", type=float, default=60.0, help="how long the load runs")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    add_workers_flag(parser)                  # the served engine's, passed to ft serve
    parser.add_argument("--serve-args", default="--device cpu --max-running-requests 4 --max-context-tokens 2048",
                        help="more `ft serve` flags (model, device, strategy)")
    for role, what in (("gpu", "the GPU worker"), ("cpu", "a CPU worker (cpu/hybrid strategies)")):
        parser.add_argument(f"--kill-{role}-worker-at-s", type=float, default=None,
                            help=f"SIGKILL {what} this far into the load")
        parser.add_argument(f"--kill-{role}-worker-every-s", type=float, default=None, help="and again every this many s")
    parser.add_argument("--max-rss-growth-mb", type=float, default=256.0, help="allowed RSS growth of the server tree")
    parser.add_argument("--max-fd-growth", type=int, default=32, help="allowed growth of its open files")
    parser.add_argument("--max-thread-growth", type=int, default=16, help="allowed growth of its threads")
    parser.add_argument("--max-mismatch-rate", type=float, default=0.0,
                        help="allowed share of good requests whose text differs from the reference (0: greedy is "
                             "batch-invariant, as on the tiny CPU model)")
    parser.add_argument("--sample-interval-s", type=float, default=1.0, help="how often the server is sampled")
    parser.add_argument("--window-s", type=float, default=10.0, help="the report's timeline window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report folder: report.json, report.png, server.log (default: a new ft-soak-* folder "
                             "in the temporary directory)")


def run(args: argparse.Namespace) -> int:
    # lazy: the soak harness loads only when `ft soak` runs (`ft --help` start-up time)
    from ftexpert.coordinator.soak.harness import Soak
    from ftexpert.coordinator.soak.probes import TreeSample, shm_segments
    from ftexpert.coordinator.soak.report import judge, kind_rows, write_report

    if (args.kill_gpu_worker_at_s is not None or args.kill_cpu_worker_at_s is not None) and args.workers != "process":
        raise ValueError("--kill-*-worker-at-s needs --workers process (there is no worker process to kill inline)")
    if args.duration_s <= 0 or args.concurrency < 1:
        raise ValueError("--duration-s must be > 0 and --concurrency >= 1")
    out_dir = args.out or tempfile.mkdtemp(prefix=f"ft-soak-{time.strftime('%Y%m%d-%H%M%S')}-")
    os.makedirs(out_dir, exist_ok=True)
    args.command_line = "ft soak " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["soak"] else ""
    soak = Soak(args, out_dir)
    before = after = TreeSample()
    inside, exit_code = float("nan"), None
    load_start = load_end = time.monotonic()
    try:
        soak.start()
        soak.take_reference()
        before = soak.sample().tree
        load_start, load_end = soak.run_load()
        settle_deadline = time.monotonic() + 15
        inside = soak.requests_inside()
        while inside > 0 and time.monotonic() < settle_deadline:
            time.sleep(0.1)
            inside = soak.requests_inside()
        time.sleep(1.0)                                      # restarted workers finish their start-up threads
        soak.read_engine_after()
        after = soak.sample().tree
    finally:
        if soak.proc is not None and soak.proc.poll() is None:
            exit_code = soak.stop()
        elif soak.proc is not None:
            exit_code = soak.proc.returncode
    leaked = sorted(shm_segments(soak.store_name)) if soak.store_name else []
    checks = judge(soak, before=before, after=after, inside=inside, exit_code=exit_code, leaked=leaked)
    report = write_report(soak, checks, start=load_start, end=load_end, before=before, after=after)
    print(f"\nsoak: {args.workers} mode, {args.concurrency} clients, {report['duration_s']:.1f} s, "
          f"{report['requests_per_s']:.1f} requests/s, {report['errors']} errors, kills: "
          + (", ".join(f"{k['role']} {'recovered in %.1f s' % k['recovered_s'] if k['recovered_s'] else 'NOT recovered'}"
                       for k in report["kills"]) or "none"))
    print(f"{'kind':<11} {'n':>6} {'ok':>6} {'wrong':>6} {'error':>6} {'outage':>6} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'p99 ms':>8}")
    for r in kind_rows(soak):
        print(f"{r['kind']:<11} {r['n']:>6} {r['ok']:>6} {r['wrong']:>6} {r['error']:>6} {r['outage']:>6} "
              f"{r['p50_ms']:>8.1f} {r['p90_ms']:>8.1f} {r['p99_ms']:>8.1f}")
    print()
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}")
    for o in [o for o in soak.outcomes if o.result in ("wrong", "error")][:5]:
        print(f"  e.g. {o.kind} {o.result}: {o.detail[:300]}")
    print(f"\nreport: {out_dir}/report.json" + (f", {out_dir}/{report['plot']}" if report["plot"] else
                                                 " (no plot: matplotlib is not installed; pip install -e '.[soak]')")
          + f", server log {soak.log_path}")
    if not all(ok for _, ok, _ in checks):
        print(f"server log, last lines:\n{soak.log_tail(2000)}")
    return 0 if all(ok for _, ok, _ in checks) else 1
