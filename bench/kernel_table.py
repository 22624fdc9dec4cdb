"""The GPU kernels of a profiled stretch of work, as one table (torch.profiler): the benches' `--profile` output;
and, for a resident decode step, the rate each kernel family reads its bytes at against the measured HBM bandwidth."""
from __future__ import annotations

import re

# kernel families of a decode step: (family, name pattern, what it reads: a key of hbm_roofline.step_bytes or "head")
FAMILIES = (
    ("experts", re.compile(r"^moe_(gate_up|down)"), "experts"),
    ("attention", re.compile(r"^decode_attn_(split|merge)"), "kv"),
    ("dense", re.compile(r"linear_gemv|gemm|nvjet|splitKreduce|cutlass|xmma"), "dense"),
)


def _kernel_events(prof):
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or
              getattr(e, "self_device_time_total", 0) > 0]
    if not events:
        return [], None
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return events, key


def kernel_rows(prof, per: int) -> list[tuple[str, float, float]]:
    """(name, us a `per`, calls a `per`) of every GPU kernel of a finished profile, by total time."""
    events, key = _kernel_events(prof)
    return [(e.key, getattr(e, key) / per, e.count / per) for e in events]


def gpu_kernel_table(prof, per: int, unit: str, top: int = 25) -> list[str]:
    """The `top` kernels of a finished `torch.profiler.profile` by total GPU time, each divided by `per` (the steps,
    turns... it covered, named by `unit`): lines to print, or one line saying no GPU kernel was recorded."""
    events, key = _kernel_events(prof)
    if not events:
        return ["profile: no GPU kernels recorded"]
    total = sum(getattr(e, key) for e in events)
    lines = [f"\nprofile: {per} {unit}(s), GPU time {total / 1e3 / per:.3f} ms a {unit}, top {top} kernels:",
             f"{'us/' + unit:>9} {'calls/' + unit:>10} {'%':>5}  name"]
    for e in events[:top]:
        t = getattr(e, key)
        lines.append(f"{t / per:>9.1f} {e.count / per:>10.1f} {100 * t / total:>5.1f}  {e.key[:90]}")
    return lines


def family_rates(rows: list[tuple[str, float, float]], parts: dict, head_bytes: int) -> list[dict]:
    """Per kernel family of a decode step (FAMILIES; a dense GEMM run once a step is the vocabulary head): its
    kernels' us a step, the bytes a step it must read (hbm_roofline.step_bytes' parts: the routed experts, the KV up
    to the context, the dense projections = the dense weights less the head) and the rate, GB/s. Families with no
    kernel in `rows` are left out."""
    dense_bytes = max(parts["weights"] - head_bytes, 0)
    need = {"experts": parts["experts"], "kv": parts["kv"], "dense": dense_bytes, "head": head_bytes}
    out: dict[str, dict] = {}
    for name, us, calls in rows:
        for family, pattern, what in FAMILIES:
            if pattern.search(name):
                if family == "dense" and calls <= 1.5:
                    family, what = "head", "head"
                f = out.setdefault(family, {"family": family, "us": 0.0, "bytes": need[what], "kernels": 0})
                f["us"] += us
                f["kernels"] += 1
                break
    for f in out.values():
        f["gb_s"] = f["bytes"] / (f["us"] * 1e-6) / 1e9 if f["us"] > 0 else 0.0
    order = ["experts", "dense", "head", "attention"]
    return sorted(out.values(), key=lambda f: order.index(f["family"]))


def family_table(rows: list[tuple[str, float, float]], parts: dict, head_bytes: int, bw: float) -> list[str]:
    """family_rates as lines, each against `bw` (bytes/s, the measured HBM rate). A kernel launched with PDL starts
    before the one ahead of it ends and its time includes that wait, so these rates are lower bounds."""
    rates = family_rates(rows, parts, head_bytes)
    if not rates:
        return []
    lines = ["kernel families of a step (bytes it must read over its kernels' time; PDL waits count: lower bounds):"]
    for f in rates:
        lines.append(f"  {f['family']:<10} {f['us']:>9.1f} us {f['bytes'] / 1e9:>8.3f} GB {f['gb_s']:>7.0f} GB/s "
                     f"{100 * f['gb_s'] * 1e9 / bw:>4.0f}% of {bw / 1e9:.0f} GB/s ({f['kernels']} kernel names)")
    return lines
