"""llama.cpp and this project side by side on one GPU: the same shapes, the same expert budgets (docs/PEERS.md).

For each job MODEL:EXPERTS (e.g. qwen3-30b-a3b:bf16, gpt-oss-120b:mxfp4), in this order (theirs, then ours):

  theirs   make_gguf.py writes the model's GGUF (seeded random weights) into --gguf-dir, then ONE llama-bench run
           over -ncmoe L, round((1-s) L) for every share s, 0 (L = the layers): the experts of that many layers
           computed on the CPU, the rest on the GPU, i.e. s of the experts' bytes on the GPU (llama.cpp's way to
           give its experts a GPU budget); each with pp1024 (prefill from an empty context) and tg128 at depth
           1024 (decode after a 1K context) (--prefill-depth 1024: the prefill a 1K chunk after the 1K context, so
           that llama-bench runs only those two of its four depth x test pairs); flash attention on, threads = physical cores, -r --runs, median of
           its samples. The file is deleted after (unless --keep-gguf). If this llama-bench knows an expert GPU
           cache option (--moe-cache-mib, not in b11434), that is said in the log; no row is made of it.
  engine   bench/bench_engine.py: resident, and offload at every share (a slot cache of s of all experts),
           decode after a --prompt-tokens prompt, --decode-tokens tokens, batch 1, each --routing-ours routing.
  hybrid   bench/bench_hybrid.py: `cpu` with the smallest cache it takes (one layer's experts: every miss computed
           on the CPU, the nearest to llama.cpp's -ncmoe L) and `hybrid split` at every --hybrid-shares share.
  prefill  bench/bench_prefill.py: TTFT of a --prompt-tokens prompt, resident and offload at every share.

Every result is appended to OUT/peer_results.jsonl as it comes (a part cut by its --part-timeout keeps what it
printed); the table at the end reads that file and any --merge files (results of earlier device calls), one row
per (model, experts, row): theirs tok/s, ours tok/s, ours / theirs.

  python bench/peer_llamacpp/run_peer.py --jobs qwen3-30b-a3b:bf16 --parts theirs,engine,hybrid,prefill --out $OUT
  python bench/peer_llamacpp/run_peer.py --table-only --merge a/peer_results.jsonl b/peer_results.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OURS_FORMAT = {"bf16": "bf16", "q8_0": "fp8", "q4_0": "nvfp4", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
TRACES = {"qwen3-30b-a3b": "trace:src/ftexpert/workload/data/qwen3-30b-a3b-routing.trace"}   # the trained trace


def log(msg: str) -> None:
    print(f"[run_peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def physical_cores() -> int:
    try:
        import psutil
        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


class Results:
    def __init__(self, path: Path):
        self.path = path

    def add(self, **rec) -> None:
        rec.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


DEADLINE = [float("inf")]      # time.monotonic() by which every command must have ended (--total-s)


def run_cmd(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Runs cmd with its output into log_path (and returns it); a timeout kills it and keeps what it printed.
    The limit is the smaller of `timeout` and what is left before the deadline (less 10 s for the table)."""
    timeout = min(timeout, DEADLINE[0] - time.monotonic() - 10)
    if timeout < 20:
        log(f"skipped (no time left before the deadline): {' '.join(cmd[:3])} ...")
        log_path.write_text("skipped: no time left\n")
        return 125, ""
    log(f"$ {' '.join(cmd)}   (limit {timeout:.0f} s, log {log_path.name})")
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        try:
            p = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = log_path.read_text(errors="replace")
    log(f"  exit {rc} after {time.perf_counter() - t0:.0f} s")
    return rc, text


def median(xs):
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else None


# -- theirs ------------------------------------------------------------------------------------------------------

def gguf_dir(args, need_bytes: int) -> Path:
    """Where the GGUF goes: --gguf-dir, else /dev/shm (memory: no disk write, and llama.cpp maps it without a
    second copy in the page cache) when it has room, else the system's temporary folder."""
    cands = [Path(args.gguf_dir)] if args.gguf_dir else [Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp"))]
    for d in cands:
        try:
            free = shutil.disk_usage(d).free
        except OSError:
            continue
        if free > need_bytes + (4 << 30):
            return d
        log(f"{d}: {free / 1e9:.1f} GB free, the file needs {need_bytes / 1e9:.1f} GB (+4 GB)")
    raise SystemExit("no folder with room for the GGUF file: give --gguf-dir")


def ncmoe_plan(n_layer: int, shares: list[float]) -> dict[int, tuple[float, float]]:
    """llama-bench's -ncmoe values for the shares of the experts' bytes on the GPU: -ncmoe N keeps the experts of N
    of the n_layer layers on the CPU, so a share s is N = round((1 - s) n_layer), whose own share 1 - N / n_layer is
    the nearest a whole layer gives (10% of 48 layers: N = 43, 10.4%). Returns N -> (the share s its row is paired
    with ours at, the share it holds); every expert on the CPU (N = n_layer) and on the GPU (N = 0) always."""
    plan = {n_layer: (0.0, 0.0)}
    for s in shares:
        n = round((1 - s) * n_layer)
        plan.setdefault(n, (s, 1 - n / n_layer))
    plan[0] = (1.0, 1.0)
    return plan


def part_theirs(args, model: str, experts: str, res: Results, out: Path) -> None:
    sys.path.insert(0, str(HERE))
    import make_gguf as mg
    shape = mg.tiny_shape(mg.ARCH_OF_PRESET[model]) if args.tiny else mg.preset_shape(model)
    bench = args.llama_bench
    if not os.access(bench, os.X_OK):
        raise SystemExit(f"no llama-bench at {bench}: bench/peer_llamacpp/build.sh cuda (docs/PEERS.md)")
    help_text = subprocess.run([bench, "--help"], capture_output=True, text=True).stdout
    has_cache = "moe-cache" in help_text
    log(f"llama-bench {bench}: expert GPU cache option {'present' if has_cache else 'absent'}"
        f"{' (not measured by this driver yet)' if has_cache else ''}")
    specs = mg.tensor_specs(shape, mg.EXPERT_TYPES[experts][0])
    need = sum(s.nbytes for s in specs) + (64 << 20)
    path = gguf_dir(args, need) / f"peer-{model}-{experts}.gguf"
    if not path.exists():
        log(f"writing {path} ({need / 1e9:.1f} GB)")
        t0 = time.perf_counter()
        r = mg.write_gguf(path, shape, experts, seed=args.seed, threads=args.gguf_threads or None, log=log)
        res.add(kind="gguf_write", model=model, experts=experts, bytes=r["bytes"], seconds=r["seconds"],
                path=str(path))
        log(f"wrote {r['bytes'] / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s")
    L = shape.n_layer
    ncmoe = ncmoe_plan(L, args.shares)
    # the most experts on the GPU first: a run cut short by its limit loses the slow CPU-heavy rows, not the others
    order = sorted(ncmoe)
    threads = args.threads or physical_cores()
    cmd = [bench, "-m", str(path), "-ngl", "99", "-ncmoe", ",".join(map(str, order)), "-fa", "1",
           "-p", str(args.prompt_tokens), "-n", str(args.decode_tokens), "-d",
           ",".join(str(d) for d in sorted({args.prefill_depth, args.prompt_tokens})),
           "-t", str(threads), "-r", str(args.runs), "-o", "jsonl"]
    try:
        rc, text = run_cmd(cmd, out / f"theirs_{model}_{experts}.log", args.part_timeout)
    finally:
        if not args.keep_gguf:
            path.unlink(missing_ok=True)
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        n_p, n_g, depth, nc = r["n_prompt"], r["n_gen"], r["n_depth"], r["n_cpu_moe"]
        share, actual = ncmoe.get(nc, (1 - nc / L, 1 - nc / L))
        if n_g == 0 and depth == args.prefill_depth:
            kind = "prefill"
        elif n_p == 0 and depth == args.prompt_tokens:
            kind = "decode"
        else:
            kind = "other"                            # the other depth of each test: kept, not in the table
        res.add(kind=kind, side="theirs", model=model, experts=experts, share=share, gpu_share=round(actual, 4),
                name=f"llama.cpp -ncmoe {nc}" + (f" ({actual:.1%})" if abs(actual - share) > 1e-6 else ""), test=f"{'pp' if n_p else 'tg'}{n_p or n_g}@d{depth}",
                tok_s=median(r.get("samples_ts", [])) or r["avg_ts"], runs=r.get("samples_ts"),
                threads=r.get("n_threads"), build=f"{r.get('build_number')} {r.get('build_commit')}",
                gpu=r.get("gpu_info"), cpu=r.get("cpu_info"))
    if rc != 0:
        log(f"llama-bench exited {rc}: see theirs_{model}_{experts}.log")


# -- ours --------------------------------------------------------------------------------------------------------

def ours_routings(args, model: str) -> list[str]:
    out = []
    for r in args.routing_ours.split(","):
        r = r.strip()
        if r == "trace":
            if model in TRACES and (REPO / TRACES[model].split(":", 1)[1]).exists():
                out.append(TRACES[model])
            else:
                log(f"no routing trace of {model} in the tree: its trace rows are left out")
        elif r:
            out.append(r)
    return out


def routing_name(spec: str) -> str:
    return spec.rsplit("/", 1)[-1].removesuffix(".trace") if spec.startswith("trace:") else spec


def part_engine(args, model: str, experts: str, res: Results, out: Path) -> None:
    routings = ours_routings(args, model)
    cmd = [sys.executable, "bench/bench_engine.py", "--preset", model, "--expert-format", OURS_FORMAT[experts],
           "--runs", str(args.runs), "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens",
           str(args.decode_tokens), "--fractions", ",".join(map(str, args.shares)), "--routing", ",".join(routings)]
    _, text = run_cmd(cmd, out / f"ours_engine_{model}_{experts}.log", args.part_timeout)
    labels = {routing_name(r): r for r in routings}
    rows = []
    for line in text.splitlines():                    # each configuration's line: NAME [run, run, run] (...)
        m = re.match(r"^(resident graphs|offload (\d+)%)(.*?) \[([^\]]*)\]", line)
        if m:
            rows.append((m.group(1) + m.group(3), m))
    misses = {}
    # the table last (bench_engine.table_line): a name (which may overrun its 20 places), then one-word cells, of
    # which miss/tok is the fifth from the end (copy GB/s, lossless, GPU GiB and RSS/exp after it)
    for line in text.splitlines():
        for name, _ in rows:
            if line.startswith(name + " ") and "[" not in line:
                cells = line[len(name):].split()
                if len(cells) >= 5:
                    try:
                        misses[name] = float(cells[-5])
                    except ValueError:
                        pass
    for name, m in rows:
        tail = m.group(3).strip()
        rname = tail if tail in labels else routing_name(routings[0])
        share = 1.0 if m.group(1).startswith("resident") else int(m.group(2)) / 100
        runs = [float(v) for v in re.findall(r"[\d.]+", m.group(4))]
        res.add(kind="decode", side="ours", model=model, experts=experts, share=share,
                name=("resident" if share == 1.0 else m.group(1)), routing=rname, tok_s=median(runs), runs=runs,
                misses_per_token=misses.get(name))


def part_hybrid(args, model: str, experts: str, res: Results, out: Path) -> None:
    """Ours' `cpu` row (its smallest cache: one layer's experts) and `hybrid split` at each --hybrid-shares: the
    first share and `cpu` in one bench_hybrid.py run over one host store (--cpu-cache), each further share in a run
    of its own."""
    sys.path.insert(0, str(REPO / "src"))
    from ftexpert.gpu_worker.checkpoint.presets import preset_config
    n_experts = preset_config(model).num_experts
    routing = ours_routings(args, model)[0]
    # no hybrid share: the cpu row alone (at its own cache)
    for i, share in enumerate(args.hybrid_shares or [None]):
        with_cpu = i == 0
        variants = ",".join((["=cpu"] if with_cpu else []) + (["=hybrid split"] if share is not None else []))
        label = ("cpu+" if with_cpu else "") + ("" if share is None else f"hybrid{share:.0%}".replace("%", ""))
        cmd = [sys.executable, "bench/bench_hybrid.py", "--preset", model, "--expert-format", OURS_FORMAT[experts],
               "--runs", str(args.runs), "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens",
               str(args.decode_tokens), "--cache", str(n_experts if share is None else share), "--variants", variants,
               "--no-resident",
               "--handoff-calls", "200", "--routing", routing,
               "--json-out", str(out / f"ours_hybrid_{model}_{experts}_{label}.json")]
        if with_cpu:
            cmd += ["--cpu-cache", str(n_experts)]
        if args.cpu_threads:
            cmd += ["--cpu-threads", str(args.cpu_threads)]
        _, text = run_cmd(cmd, out / f"ours_hybrid_{model}_{experts}_{label}.log", args.part_timeout)
        for name, tok_s, runs in hybrid_rows(text):
            cpu_row = name == "cpu"
            res.add(kind="decode", side="ours", model=model, experts=experts, share=0.0 if cpu_row else share,
                    name=f"{name} (cache {n_experts if cpu_row else share})", routing=routing_name(routing),
                    tok_s=median(runs) or tok_s, runs=runs)


def hybrid_rows(text: str) -> list[tuple[str, float, list[float]]]:
    """bench_hybrid.py's "row:" lines (as each row ends: NAME, tok/s, ..., [the runs' tok/s]) -> (name, tok/s, runs)."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"^row: (\S.*?)\s+(\d+\.\d+)\s.*\[([^\]]*)\]\s*$", line)
        if m:
            rows.append((m.group(1), float(m.group(2)), [float(v) for v in re.findall(r"[\d.]+", m.group(3))]))
    return rows


def part_prefill(args, model: str, experts: str, res: Results, out: Path) -> None:
    routing = ours_routings(args, model)[0]
    cmd = [sys.executable, "bench/bench_prefill.py", "--preset", model, "--expert-format", OURS_FORMAT[experts],
           "--runs", str(args.runs), "--prompt-tokens", str(args.prompt_tokens), "--chunks", "4096",
           "--fractions", ",".join(map(str, args.shares)), "--routing", routing]
    _, text = run_cmd(cmd, out / f"ours_prefill_{model}_{experts}.log", args.part_timeout)
    for line in text.splitlines():
        m = re.match(r"^(resident|offload (\d+)%)\S*.*? chunk \d+: TTFT \[([^\]]*)\]", line)
        if m:
            ttft = [float(v) for v in re.findall(r"[\d.]+", m.group(3))]
            share = 1.0 if m.group(1) == "resident" else int(m.group(2)) / 100
            res.add(kind="prefill", side="ours", model=model, experts=experts, share=share, name=m.group(1),
                    routing=routing_name(routing), tok_s=args.prompt_tokens / median(ttft),
                    runs=[round(args.prompt_tokens / t, 2) for t in ttft])


PARTS = {"theirs": part_theirs, "engine": part_engine, "hybrid": part_hybrid, "prefill": part_prefill}


# -- the table ---------------------------------------------------------------------------------------------------

def table(records: list[dict]) -> str:
    """One row per (model, experts, kind, share, ours' configuration): theirs at that share, ours, ours / theirs.
    A share of 1.0 is every expert on the GPU; 0.0 every expert on the CPU (ours: `cpu` with the smallest cache)."""
    recs = [r for r in records if r.get("kind") in ("decode", "prefill")]
    theirs = {}
    for r in recs:
        if r["side"] == "theirs":
            theirs[(r["model"], r["experts"], r["kind"], round(r["share"], 3))] = r
    lines = ["| model | experts | row | experts on GPU | llama.cpp | llama.cpp tok/s | ours | routing (ours) | "
             "ours tok/s | ours / llama.cpp |", "|---|---|---|---|---|---:|---|---|---:|---:|"]
    seen = set()
    keyed = sorted(recs, key=lambda r: (r["model"], r["experts"], r["kind"] != "decode", -r["share"],
                                        r["side"] != "theirs", r.get("name", "")))
    for r in keyed:
        key = (r["model"], r["experts"], r["kind"], round(r["share"], 3))
        t = theirs.get(key)
        if r["side"] == "theirs":
            if any(o["side"] == "ours" and (o["model"], o["experts"], o["kind"], round(o["share"], 3)) == key
                   for o in recs):
                continue                               # shown beside ours
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"| {r['model']} | {r['experts']} | {r['kind']} | {r['share']:.0%} | {r['name']} | "
                         f"{r['tok_s']:.2f} | - | - | - | - |")
            continue
        ratio = f"{r['tok_s'] / t['tok_s']:.2f}" if t and t.get("tok_s") else "-"
        miss = f", {r['misses_per_token']:.1f} miss/tok" if r.get("misses_per_token") is not None else ""
        their_tok = f"{t['tok_s']:.2f}" if t else "-"
        lines.append(f"| {r['model']} | {r['experts']} | {r['kind']} | {r['share']:.0%} | "
                     f"{t['name'] if t else 'not measured'} | {their_tok} | {r['name']} | "
                     f"{r.get('routing', '-')}{miss} | {r['tok_s']:.2f} | {ratio} |")
    return "\n".join(lines)


def read_records(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        if p.exists():
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    # the newest record of each (side, model, experts, kind, share, name, routing, test) wins
    last = {}
    for r in out:
        last[(r.get("side"), r.get("model"), r.get("experts"), r.get("kind"), r.get("share"), r.get("name"),
              r.get("routing"), r.get("test"))] = r
    return list(last.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="qwen3-30b-a3b:bf16", help="comma list of MODEL:EXPERTS (make_gguf.py's names)")
    p.add_argument("--parts", default="theirs,engine,hybrid,prefill", help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--shares", default="0.1,0.25,0.5", help="shares of the experts' bytes on the GPU")
    p.add_argument("--hybrid-shares", default="0.25", help="ours' hybrid rows (each a bench_hybrid.py run)")
    p.add_argument("--routing-ours", default="model,zipf:1.0,trace",
                   help="ours' routings: model (the preset's own router on its random weights, as llama.cpp's), "
                        "zipf:S, trace (the model's trained trace where the tree has one); engine runs each, "
                        "hybrid and prefill the first")
    p.add_argument("--prefill-depth", type=int, default=0,
                   help="theirs: the context before the pp test: 0 (from empty) or --prompt-tokens (after the decode "
                        "test's context: llama-bench then runs half as many tests)")
    p.add_argument("--threads", type=int, default=0, help="llama-bench -t (default: physical cores, as ours)")
    p.add_argument("--cpu-threads", type=int, default=0, help="ours' CPU pool threads (default: its own)")
    p.add_argument("--llama-bench", default=str(HERE / "bin" / "cuda" / "llama-bench"))
    p.add_argument("--gguf-dir", default="", help="default: /dev/shm when it has room, else $TMPDIR or /tmp")
    p.add_argument("--keep-gguf", action="store_true")
    p.add_argument("--gguf-threads", type=int, default=0, help="make_gguf.py's threads (default: cores, at most 16)")
    p.add_argument("--tiny", action="store_true", help="theirs: make_gguf.py's tiny shape of the model (a smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--part-timeout", type=float, default=540, help="seconds each command may run")
    p.add_argument("--total-s", type=float, default=0,
                   help="seconds from start by which every command must have ended (the device tool stops a command "
                        "at 600 s: give ~570 there); 0: no limit")
    p.add_argument("--merge", nargs="*", default=[], help="more peer_results.jsonl files for the table")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    if args.prefill_depth not in (0, args.prompt_tokens):
        raise SystemExit(f"--prefill-depth {args.prefill_depth}: give 0 or --prompt-tokens ({args.prompt_tokens})")
    args.shares = [float(s) for s in args.shares.split(",") if s.strip()]
    args.hybrid_shares = [float(s) for s in args.hybrid_shares.split(",") if s.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = Results(out / "peer_results.jsonl")
    if args.total_s:
        DEADLINE[0] = time.monotonic() + args.total_s
    if not args.table_only:
        parts = [s.strip() for s in args.parts.split(",") if s.strip()]
        for bad in set(parts) - set(PARTS):
            raise SystemExit(f"--parts: unknown {bad!r}; give some of {', '.join(PARTS)}")
        for job in [j.strip() for j in args.jobs.split(",") if j.strip()]:
            model, _, experts = job.partition(":")
            if experts not in OURS_FORMAT:
                raise SystemExit(f"--jobs {job!r}: experts one of {', '.join(OURS_FORMAT)}")
            for part in parts:
                log(f"== {model} {experts}: {part}")
                try:
                    PARTS[part](args, model, experts, res, out)
                except SystemExit as exc:
                    log(f"{part} stopped: {exc}")
                except Exception as exc:                 # a broken part leaves the others their time
                    log(f"{part} failed: {type(exc).__name__}: {exc}")
    recs = read_records([out / "peer_results.jsonl", *map(Path, args.merge)])
    text = table(recs)
    (out / "peer_table.md").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
