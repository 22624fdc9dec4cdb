"""Where a decode layer's time goes, from a Chrome trace of `bench_engine.py --profile N --trace-dir D`.

A layer is the stretch from one `moe_sum_k_kernel` end (the previous layer's MoE output) to the next.
Within it, with the plan copy (`copy_plan_kernel`) as the landmark of an offload layer:

    before copy  previous sum end -> copy start: attention, norms, router, ensure (nothing to copy yet)
    copy         first copy kernel start -> last copy kernel end (a copy in two parts, w13 then w2, has
                 two kernels: `copy gap` is the idle time between them)
    after copy   copy end -> this layer's sum end: the fetched routes' GEMMs and the sum (the tail)
    layer        previous sum end -> this sum end

and, for every layer, the busy time of each kernel family inside it (a kernel counts in the layer
where it starts). Medians and means over the layers, in us; a layer without a copy kernel (a resident
run, or an offload layer without misses) reports only `layer` and the families.

    python bench/trace_summary.py [--timeline N] TRACE.json [TRACE.json ...]

--timeline N also prints the kernels of N layers with copies (start relative to the layer's start,
duration, stream), to see what runs beside what.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

SUM = "moe_sum_k_kernel"
COPY = "copy_plan_kernel"
FAMILIES = {
    "moe_gate_up_kernel": "gate/up", "moe_down_kernel": "down", SUM: "sum_k", COPY: "copy",
    "ensure": "ensure", "nvjet": "dense GEMM", "gemv": "dense GEMM", "splitKreduce": "dense GEMM",
    "linear_gemv": "dense GEMM", "linear_split": "dense GEMM", "decode_attn": "attention", "index_copy": "kv write", "rms_norm": "norms",
    "qk_norm_rope": "norms", "route_topk": "router", "count_call": "counters",
    "join_kernel": "join (waits for the CPU)", "ring_kernel": "ring", "split_pick": "split pick",
    "split_copy": "split copy",
}


def family(name: str) -> str:
    for key, fam in FAMILIES.items():
        if key in name:
            return fam
    return "other"


def kernels(path: str) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out, key=lambda e: e["ts"])


def layers(evs: list[dict]) -> list[dict]:
    sums = [e for e in evs if SUM in e["name"]]
    rows = []
    for prev, cur in zip(sums, sums[1:]):
        t0, t1 = prev["ts"] + prev["dur"], cur["ts"] + cur["dur"]
        if t1 - t0 > 5000:                      # a step boundary (sampling, host work): not a layer
            continue
        inside = [e for e in evs if t0 <= e["ts"] < t1 and e is not cur]
        row = {"layer": t1 - t0}
        busy = defaultdict(float)
        for e in inside + [cur]:
            busy[family(e["name"])] += e["dur"]
        row["families"] = dict(busy)
        copies = [e for e in inside if COPY in e["name"]]
        if copies:
            first, last = copies[0], max(copies, key=lambda e: e["ts"] + e["dur"])
            row["before copy"] = first["ts"] - t0
            row["copy"] = last["ts"] + last["dur"] - first["ts"]
            row["copy gap"] = row["copy"] - sum(e["dur"] for e in copies)
            row["after copy"] = t1 - (last["ts"] + last["dur"])
            row["timeline"] = [(e["ts"] - t0, e["dur"], e.get("tid", "?"), e["name"]) for e in inside + [cur]]
        rows.append(row)
    return rows


def summarise(path: str, timeline: int = 0) -> None:
    rows = layers(kernels(path))
    print(f"\n{path}: {len(rows)} layers")
    if not rows:
        return
    for r in [r for r in rows if "timeline" in r][:timeline]:
        print(f"  layer of {r['layer']:.1f} us:")
        for start, dur, stream, name in r["timeline"]:
            print(f"    {start:8.1f} +{dur:7.1f}  stream {stream!s:<6} {name[:70]}")
    for key in ("layer", "before copy", "copy", "copy gap", "after copy"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            print(f"  {key:<12} median {statistics.median(vals):8.1f} us  mean {statistics.mean(vals):8.1f} us  "
                  f"({len(vals)} layers)")
    fams = sorted({f for r in rows for f in r["families"]})
    print("  busy time a layer by kernel family (mean us; families overlap across streams):")
    for fam in sorted(fams, key=lambda f: -statistics.mean(r["families"].get(f, 0.0) for r in rows)):
        print(f"    {fam:<12} {statistics.mean(r['families'].get(fam, 0.0) for r in rows):8.1f}")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    timeline = 0
    if argv[:1] == ["--timeline"]:
        timeline, argv = int(argv[1]), argv[2:]
    for path in argv:
        summarise(path, timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
