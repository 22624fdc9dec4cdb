"""The soak's verdict and its report: checks (answers, errors, requests left inside, growth of memory, open
files, threads and shared memory, recovery from each kill, a clean stop), a table per request kind, a
timeline in windows (tok/s, latency percentiles, token gaps, fault marks), written as report.json and, where
matplotlib is installed (the `soak` extra), report.png."""
from __future__ import annotations

import collections
import json
import math
import os

from ftexpert.coordinator.soak.harness import GOOD_KINDS, KINDS, OUTAGE_GRACE_S, Soak


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def kind_rows(soak: Soak) -> list[dict]:
    by_kind = collections.defaultdict(list)
    for o in soak.outcomes:
        by_kind[o.kind].append(o)
    rows = []
    for kind in list(KINDS) + [k for k in by_kind if k not in KINDS]:
        os_ = by_kind.get(kind, [])
        lat = [o.latency_s * 1000 for o in os_ if o.result == "ok"]
        count = collections.Counter(o.result for o in os_)
        rows.append({"kind": kind, "n": len(os_), "ok": count["ok"], "wrong": count["wrong"], "error": count["error"],
                     "outage": count["outage"], "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90),
                     "p99_ms": percentile(lat, 99)})
    return rows


def timeline(soak: Soak, start: float, end: float, window_s: float) -> list[dict]:
    """Per window: tok/s (from the server's generated-tokens counter), good-request latency percentiles (an agent
    conversation is several requests: its time is in the kind table only), the
    longest and p99 gap between stream events, requests by result."""
    windows = []
    n = max(1, math.ceil((end - start) / window_s))
    samples = [s for s in soak.samples if not math.isnan(s.generated_tokens)]
    for i in range(n):
        lo, hi = start + i * window_s, min(end, start + (i + 1) * window_s)
        inside = [o for o in soak.outcomes if lo <= o.started + o.latency_s < hi]
        lat = [o.latency_s * 1000 for o in inside if o.result == "ok" and o.kind in GOOD_KINDS and o.kind != "agent"]
        gaps = [o.max_gap_s * 1000 for o in inside if o.max_gap_s is not None and o.result == "ok"]
        edge = [s for s in samples if lo <= s.t <= hi]
        tok_s = ((edge[-1].generated_tokens - edge[0].generated_tokens) / (edge[-1].t - edge[0].t)
                 if len(edge) >= 2 and edge[-1].t > edge[0].t else float("nan"))
        results = collections.Counter(o.result for o in inside)
        windows.append({"t_s": lo - start, "tok_s": tok_s, "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90),
                        "p99_ms": percentile(lat, 99), "gap_p99_ms": percentile(gaps, 99),
                        "gap_max_ms": max(gaps, default=float("nan")), **{f"n_{k}": v for k, v in results.items()}})
    return windows


def growth_checks(args, before, after) -> list[tuple[str, bool, str]]:
    mb = (after.rss_bytes - before.rss_bytes) / 1e6
    fds, threads = after.open_files - before.open_files, after.threads - before.threads
    return [
        ("RSS growth bounded", mb <= args.max_rss_growth_mb,
         f"{before.rss_bytes / 1e6:.0f} -> {after.rss_bytes / 1e6:.0f} MB ({mb:+.0f} MB, limit {args.max_rss_growth_mb:g})"),
        ("open files: no growth", fds <= args.max_fd_growth,
         f"{before.open_files} -> {after.open_files} ({fds:+d}, limit {args.max_fd_growth})"),
        ("threads: no growth", threads <= args.max_thread_growth,
         f"{before.threads} -> {after.threads} ({threads:+d}, limit {args.max_thread_growth})"),
        ("shared memory: no growth", after.shm_segments <= before.shm_segments and after.shm_bytes <= before.shm_bytes,
         f"{before.shm_segments} segments / {before.shm_bytes / 1e6:.1f} MB -> {after.shm_segments} / "
         f"{after.shm_bytes / 1e6:.1f} MB"),
    ]


MIN_PREFIX_HIT_SHARE = 0.5    # of the prompt tokens the engine looked up (agent histories dominate them)


def engine_checks(soak: Soak) -> list[tuple[str, bool, str]]:
    """From the engine's figures after the load: no KV block held by a request (every block is free or cached),
    and, with the prefix cache on, the agents' shared system prompt and histories found in it. A GPU-worker kill
    restarts the figures with the new engine: they cover the engine that served last."""
    stats = soak.engine_after
    checks = []
    if "kv_blocks_used" in stats:
        checks.append(("KV blocks: none held after the load", stats["kv_blocks_used"] == 0,
                       f"{stats['kv_blocks_used']:g} used, {stats.get('kv_blocks_cached', 0):g} cached, "
                       f"{stats.get('kv_blocks_free', 0):g} free of {stats.get('kv_blocks_total', 0):g}"))
    if stats.get("kv_window_blocks_total"):         # the sliding-window layers' pool (gpt-oss)
        checks.append(("KV window blocks: none held after the load", stats.get("kv_window_blocks_used", 0) == 0,
                       f"{stats.get('kv_window_blocks_used', 0):g} used of {stats['kv_window_blocks_total']:g}"))
    if stats.get("prefix_cache_enabled"):
        queried = stats.get("prefix_cache_query_tokens_total", 0.0)
        hit = stats.get("prefix_cache_hit_tokens_total", 0.0)
        agents_ok = any(o.kind == "agent" and o.result == "ok" for o in soak.outcomes)
        share = hit / queried if queried else 0.0
        checks.append(("prefix cache: agent histories reused", not agents_ok or share >= MIN_PREFIX_HIT_SHARE,
                       f"{hit:g} of {queried:g} prompt tokens found in the cache ({share:.0%}, at least "
                       f"{MIN_PREFIX_HIT_SHARE:.0%})"))
    return checks


def judge(soak: Soak, *, before, after, inside: float, exit_code, leaked: list[str]) -> list[tuple[str, bool, str]]:
    args = soak.args
    for o in soak.outcomes:
        o.result = soak.classify(o.result, o.started, o.started + o.latency_s)
    good = [o for o in soak.outcomes if o.kind in GOOD_KINDS]
    errors = sum(1 for o in soak.outcomes if o.result == "error")
    mismatch = sum(1 for o in good if o.result == "wrong") / max(1, len(good))
    checks = [("requests answered", bool(soak.outcomes) and bool(good), f"{len(soak.outcomes)} requests, {len(good)} good"),
              ("greedy/seeded answers match the reference", mismatch <= args.max_mismatch_rate,
               f"mismatch rate {mismatch:.4f}"),
              ("bad requests refused with a 4xx JSON error",
               not any(o.result == "wrong" for o in soak.outcomes if o.kind == "bad"), ""),
              ("no unexpected errors", errors == 0, f"{errors} errors"),
              ("no request left inside the server", inside == 0, f"{inside:g} running+waiting")]
    checks += engine_checks(soak)
    checks += growth_checks(args, before, after)
    for role in ("gpu", "cpu"):
        kills = [k for k in soak.kills if k.role == role]
        if getattr(args, f"kill_{role}_worker_at_s") is None:
            continue
        last = kills[-1].recovered if kills else None
        after_ok = [o for o in good if last and o.started > last + OUTAGE_GRACE_S and o.result == "ok"]
        note = ", ".join(f"recovered in {k.recovered - k.at:.1f} s" if k.recovered else "NOT recovered" for k in kills)
        checks.append((f"{role.upper()} worker killed, restarted, serving again",
                       bool(kills) and all(k.recovered for k in kills) and bool(after_ok),
                       f"{len(kills)} kill(s): {note or 'none'}; {len(after_ok)} good answers after the last"))
    checks.append(("SIGTERM stops the server with exit code 0", exit_code == 0, f"exit code {exit_code}"))
    checks.append(("no /dev/shm segment left", not leaked, ", ".join(leaked) or "none"))
    return checks


def write_report(soak: Soak, checks, *, start: float, end: float, before, after) -> dict:
    args = soak.args
    windows = timeline(soak, start, end, args.window_s)
    total = len(soak.outcomes)
    report = {
        "command": getattr(args, "command_line", ""), "workers": args.workers, "serve_args": args.serve_args,
        "concurrency": args.concurrency, "duration_s": end - start, "requests_total": total,
        "requests_per_s": total / max(1e-9, end - start),
        "errors": sum(1 for o in soak.outcomes if o.result == "error"),
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks], "kinds": kind_rows(soak),
        "before": before.as_dict(), "after": after.as_dict(),
        "kills": [{"role": k.role, "pid": k.pid, "at_s": k.at - start,
                   "recovered_s": (k.recovered - k.at) if k.recovered else None} for k in soak.kills],
        "agent_scripts": [{"turns": len(sc.turns), "prompt_tokens": sc.prompt_tokens} for sc in soak.scripts],
        "engine_after": soak.engine_after,
        "timeline": windows,
        "samples": [{"t_s": s.t - start, "generated_tokens": s.generated_tokens, **s.tree.as_dict()}
                    for s in soak.samples],
        "server_log": os.path.basename(soak.log_path),
    }
    report["plot"] = plot(report, os.path.join(soak.out_dir, "report.png"))
    with open(os.path.join(soak.out_dir, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str, allow_nan=True)
    return report


def plot(report: dict, path: str) -> str | None:
    """report.png: tok/s; latency p50/p90/p99; stream token gaps; RSS, open files and threads; kills marked.
    None (and no file) without matplotlib (`pip install -e ".[soak]"`)."""
    try:
        # optional: matplotlib (the soak extra)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    w = report["timeline"]
    t = [x["t_s"] for x in w]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(t, [x["tok_s"] for x in w], marker=".")
    axes[0].set_ylabel("generated tok/s")
    for q in ("p50_ms", "p90_ms", "p99_ms"):
        axes[1].plot(t, [x[q] for x in w], marker=".", label=q.replace("_ms", ""))
    axes[1].set_ylabel("latency ms (good requests)")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, [x["gap_p99_ms"] for x in w], marker=".", label="p99")
    axes[2].plot(t, [x["gap_max_ms"] for x in w], marker=".", label="max")
    axes[2].set_ylabel("stream token gap ms")
    axes[2].legend(loc="upper right")
    s = report["samples"]
    ts = [x["t_s"] for x in s]
    axes[3].plot(ts, [x["rss_bytes"] / 1e6 for x in s], label="RSS MB")
    axes[3].plot(ts, [x["open_files"] for x in s], label="open files")
    axes[3].plot(ts, [x["threads"] for x in s], label="threads")
    axes[3].set_ylabel("server process tree")
    axes[3].legend(loc="upper right")
    axes[3].set_xlabel("s into the load")
    for ax in axes:
        for k in report["kills"]:
            ax.axvline(k["at_s"], color="red" if k["role"] == "gpu" else "orange", linestyle="--", linewidth=1)
    axes[0].set_title(f"ft soak: {report['workers']} mode, {report['concurrency']} clients; dashed: kills "
                      f"(red GPU worker, orange CPU worker)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return os.path.basename(path)
