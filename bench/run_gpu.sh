#!/usr/bin/env bash
# The GPU machine's tests and benchmarks, in suites named by what they check; each suite ends with a short table.
# Usage: bash bench/run_gpu.sh [SUITE ...]          (default: tests)
#        bash bench/run_gpu.sh compare OLD_TREE     (the headline benchmarks of OLD_TREE and of this tree side by side)
#   tests    every test marked gpu; TESTS_WORKERS pytest-xdist workers (6 fill one call), TESTS_ARGS instead of
#            tests/, TESTS_TIMEOUT (s)                                                        (~8 min)
#   kernels  slot-cache ensure kernel, decode attention, the MoE decode kernels (bf16 and quantized)  (~4 min)
#   tuning   the 4-bit MoE GEMV's block sweep (and its scale a group's sum) at gpt-oss-120b's and qwen3-next's shapes;
#            the dense projections' LinearBlocks sweep at the same models' shapes; the decode attention's num_stages
#                                                                                            (~4 min)
#   quant_mma the tensor-core 4-bit gate/up and down (GemvBlocks.quant_mma, quant_mma_down) timed beside the
#            defaults at gpt-oss-120b's and qwen3-next's shapes (bench_moe_decode_quant.py --mma-sweep, T = 1 and 4),
#            then their GPU tests (~4 min); MMA_PARTS=engine (a call of its own): qwen3-next-80b-a3b's resident decode
#            with the defaults and with both on the tensor cores (bench_engine.py --quant-gemv default|mma; ~8 min)
#   quant_profile  where the 4-bit MoE decode GEMV's time goes at qwen3-next's NVFP4 and gpt-oss-120b's MXFP4 shapes:
#            the K loops of the kernels as this machine's Triton compiles them (SASS), then Nsight Compute's counters
#            of two calls (speed of light, occupancy, warp stalls per issued instruction; bench/profile_quant_gemv.py)
#                                                                                            (~3 min)
#   engine   resident decode, offload at 10 / 25 / 50% (qwen3-30b-a3b preset), TTFT at 1K     (~6 min)
#   hybrid   hybrid at 25%, the hand-off round trip, the CPU expert kernel                   (~6 min)
#   prefill  TTFT at 1K and 4K prompts: resident, offload 25%, hybrid 25%                     (~5 min)
#   cpu      the host's CPU expert kernel alone, 4-bit formats: bench_cpu_experts.py at batch 1 / 4, 8 and 1 experts a
#            call, then bench_cpu_phases.py (where a call's time goes: phases, barriers, the parts around) (~1 min)
#   cpu_ab OLD_TREE  bench_cpu_phases.py of OLD_TREE and of this tree, CPU_AB_ROUNDS (3) rounds interleaved  (~2 min)
#   workload trains the olmoe-routing and qwen3-30b-a3b-routing shapes (WORKLOAD_MINUTES each, default 6.5, side by
#            side on the one GPU) and the embedded default model (DEFAULT_TOKENS, default 40M); routing statistics
#            of both routing shapes (16,384 held-out tokens), the qwen3 trace (4,096 tokens); all of it, with the
#            default model, in $OUT/workload.tar.xz                                            (~10 min)
#   routing  zipf:1.0 against the trained trace (src/ftexpert/workload/data/qwen3-30b-a3b-routing.trace) at the qwen3-30b-a3b
#            shape: offload at 10 / 25 / 50% and hybrid at 25%, misses per token and rooflines  (~5 min)
#   prefetch the lookahead prefetch at the qwen3-30b-a3b shape on the trained trace, off against auto, in parts
#            (PREFETCH_PART, one device call each): bf16 and nvfp4 (offload at 10 / 25 / 50%, batch PREFETCH_BATCH
#            1 or 4; ~5 min each), hybrid (offload and hybrid at 25%, bf16 and nvfp4; ~6 min), budgets (the fixed
#            budgets 2 / 4 / 8 and measure against off and auto; ~5 min), long (nvfp4 25% at a 32K context), zipf
#            (nvfp4 under zipf:1.0), gptoss (gpt-oss-120b MXFP4, its own router). PREFETCH_TOKENS decode tokens a run (64);
#            PREFETCH_MODES the modes of those parts (default off,auto; off,auto,measure adds auto's probe without a prediction);
#            bf16 and nvfp4 also write the auto runs' probe samples to $OUT/prefetch_probe_<part>_b<batch>.json
#            (recorded timings for the budget rule's tests) and, with PREFETCH_PROFILE=N, print the GPU kernels of N
#            decode steps of each configuration
#   prefetch_trained  trains olmoe-routing (PREFETCH_TRAIN_MINUTES, default 3); its prediction quality at budgets
#            1, 2, 4, 8; ft serve prefetch off against on, 60 cold prompts, 256 tokens (the openai wheel in .whl/)
#   architectures  qwen3-next-80b-a3b (NVFP4) and gpt-oss-120b: resident and offload at 10 / 25 / 50%; TTFT at 32K
#            of qwen3-next-80b-a3b against qwen3-30b-a3b (~10 min: more than one call; ARCH_PARTS, some of next gptoss
#            ttft); ARCH_FRACTIONS the offload shares (0.1,0.25,0.5; empty: resident only); ARCH_PROFILE N: the
#            kernels of N profiled decode steps after each row (bench_engine.py --profile); ARCH_OLD=DIR: each engine
#            row also in an older checkout (git archive REV src bench), right after this tree's, without the profile
#   soak     ft soak on the GPU for SOAK_S s (default 540), hybrid, CPU- and GPU-worker kills; report in $OUT/soak
#   peer_build  builds llama-bench (CUDA sm_90) from bench/peer_llamacpp/llama.cpp (carry it; fetch_source.sh makes
#            it) and packs bench/peer_llamacpp/bin/cuda into $OUT/peer_bin_cuda.tar.xz.part-* (carry those back as
#            bench/peer_llamacpp/dist/ for later calls); PEER_BUILD_LIMIT s (default 590)          (~6-9 min)
#   peer     llama.cpp side by side (docs/PEERS.md): bench/peer_llamacpp/run_peer.py over PEER_JOBS (default
#            qwen3-30b-a3b:bf16) and PEER_PARTS (default theirs,engine,hybrid,prefill); llama-bench from
#            bench/peer_llamacpp/bin/cuda, else unpacked from bench/peer_llamacpp/dist/; PEER_MERGE: earlier
#            peer_results.jsonl files for the table; PEER_ARGS: more run_peer.py flags           (~9 min a job)
#   grammar  structured output: the gpu test of tests/gpu_worker/test_engine_grammar.py (graphs and overlap on) and
#            bench/bench_grammar.py at the qwen3-30b-a3b preset, batch 1 and 16, masks over GRAMMAR_TOKENIZER (default
#            .whl/qwen3-tokenizer.json, written by bench/qwen_vocab.py; without it the preset's tiny vocabulary); needs
#            the llguidance wheel in .whl/ (docs/DEPENDENCIES.md)                                 (~3 min)
#   batch    throughput at batch (BATCH_SIZES, default 1 4 16; BATCH_PRESET; BATCH_FRACTIONS, default none: resident
#            only): bench_engine.py --batch B, and at B > 1 auto eager and in graphs, with --expert-compute gemv
#            beside it                                                                       (~1.5 min a run)
#   prefix   the paged KV cache (bench_prefix_cache.py, qwen3-30b-a3b-128k): a 500-token turn on a 32K history with the
#            prefix cache off and on, decode at 1K / 32K / 128K, batch 16 at 8K; resident, then offload 25% (PREFIX_PARTS;
#            its routing PREFIX_ROUTING, default zipf:1.0 as the engine suite's: the preset's random router sends
#            nearly every token to the same experts; the experts each turn fetched and the misses a decode token);
#            PREFIX_PROFILE=1: the kernels of one more turn of each kind (bench_prefix_cache.py --profile);
#            PREFIX_PARTS=next: the same turn on qwen3-next-80b-a3b (NVFP4, resident), whose hits resume kept states;
#            PREFIX_PARTS=gptoss: the turn and decode at 1K / 32K / 128K on gpt-oss-120b (MXFP4, resident, YaRN x32);
#            first, bench_prefill_attention.py: one layer's attention of the hit's 516-token chunk and of a 4K chunk
#                                                                                            (~9 min)
#   all      tests kernels engine hybrid prefill (more than one device call's 10 minutes: run suites one by one)
#   compare OLD_TREE  OLD_TREE is an older checkout (e.g. `git archive OLDREV | tar -x -C /tmp/old`); its benches take
#            the flags of that tree (the old side's commands below), this tree's the current ones; one table, both
#            columns (~9 min; COMPARE_STRETCH=150 gives each command 1.5x its limit). HYBRID_VARIANT and
#            OLD_HYBRID_VARIANT name the hybrid row (bench_hybrid.py --variants) of this tree and of the old one;
#            COMPARE_PARTS picks some of: rows25 engine hybrid handoff ensure ttft_1k (default: rows25 ensure, which
#            fits one call: rows25 is resident, offload 25% and hybrid 25% from one bench_hybrid.py run a side, so
#            each side fills its 58 GB host store once; engine and hybrid fill one each).
# The packages the GPU machine lacks: `bash bench/gpu_wheels.sh` here writes them into .whl/ (carried; installed below).
# SECTION_TIMEOUT (s, default 540) bounds each command of a suite. Logs go to $OUT (the device tool's output folder)
# when it is set, else ./out; docs/BENCHMARKS.md says what each figure is and where it stands.
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
# The tree's import root (src/, which holds the ftexpert package) first on PYTHONPATH: the GPU machine runs the
# checkout without installing it. `compare` also runs an older tree, whose packages may sit at its top level.
importroot() { if [ -d "$1/src/ftexpert" ]; then echo "$1/src"; else echo "$1"; fi; }
mod() { if [ -d src/ftexpert ]; then echo "ftexpert.$1"; else echo "$1"; fi; }   # a module of the tree in the cwd
BASE_PYTHONPATH=${PYTHONPATH:-}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && BASE_PYTHONPATH=${BASE_PYTHONPATH:+$BASE_PYTHONPATH:}/tmp/site
fi
use_tree() { export PYTHONPATH=$(importroot "$1")${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}; }
export PYTHONUNBUFFERED=1
use_tree "$PWD"
T=${SECTION_TIMEOUT:-540}
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

# The hybrid decode row and the prefill variants by name (bench_hybrid.py --variants, bench_prefill.py --variants)
export HYBRID_VARIANT=${HYBRID_VARIANT:-=hybrid split}
PREFILL_VARIANTS=${PREFILL_VARIANTS:-}          # empty: bench_prefill.py's default variants

# run NAME TIMEOUT CMD...: the command's output into $OUT/NAME.log (and its last lines on the console)
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "   ($name exited $?)"; status=1; }
  tail -n 3 "$OUT/$name.log" | cut -c1-200
}

# summary LABEL=DIR ...: one table of the headline figures found in each DIR's logs (a column per DIR)
summary() {
  python3 - "$@" <<'PY'
import json, os, re, statistics, sys

def read(d, name):
    try:
        with open(os.path.join(d, name + ".log"), errors="replace") as fh:
            return fh.read().splitlines()
    except OSError:
        return []

def median_list(text):
    vals = [float(v) for v in re.findall(r"[\d.]+", text)]
    return statistics.median(vals) if vals else None

def run_median(lines, pattern):         # a bench's per-configuration line: NAME [run, run, run] ...
    for line in lines:
        m = re.match(pattern + r"[^\[]*\[([^\]]+)\]", line)
        if m:
            return median_list(m.group(1))
    return None

def hybrid_row(lines, variant):          # bench_hybrid.py's "row: NAME  tok/s ..." lines; several rounds: median
    name = variant.lstrip("=")
    vals = [float(m.group(1)) for line in lines
            for m in [re.match(r"row: " + re.escape(name) + r"(?: round \d+)?\s+(\d+\.\d+)\s", line)] if m]
    return statistics.median(vals) if vals else None

def handoff_p50(lines):                  # bench_handoff.py: the device kernels in a CUDA graph, per call
    for line in lines:
        if "CUDA graph of" in line:
            cells = line.rsplit(")", 1)[1].split()
            return float(cells[1]) if len(cells) > 1 else None
    return None

def handoff_line(lines):                 # bench_hybrid.py: "hand-off round trip: p50 X us, p99 Y us"
    for line in lines:
        m = re.match(r"hand-off round trip: p50 ([\d.]+) us", line)
        if m:
            return float(m.group(1))
    return None

def ensure_us(lines, slots, column):     # kernels.slot_cache.bench: the default setting's row
    for line in lines:
        cells = line.split()
        if line.rstrip().endswith("<- default") and cells and cells[0] == str(slots):
            return float(cells[-4 + column])         # ... all-hits us, 1-fetch us, "<-", "default"
    return None

def ttft(lines, pattern):               # bench_prefill.py: "NAME chunk C: TTFT [runs] s"
    for line in lines:
        m = re.match(pattern + r"[^:]* chunk \d+: TTFT \[([^\]]+)\]", line)
        if m:
            return median_list(m.group(1))
    return None

variant = os.environ.get("HYBRID_VARIANT", "=hybrid split")
old_variant = os.environ.get("OLD_HYBRID_VARIANT", variant)
METRICS = [
    ("resident decode, tok/s", lambda d, old: run_median(read(d, "engine"), r"resident")),
    ("offload 10%, tok/s", lambda d, old: run_median(read(d, "engine"), r"offload (?:0\.1 |10%)")),
    ("offload 25%, tok/s", lambda d, old: run_median(read(d, "engine"), r"offload (?:0\.25 |25%)")),
    ("offload 50%, tok/s", lambda d, old: run_median(read(d, "engine"), r"offload (?:0\.5 |50%)")),
    ("hybrid 25%, tok/s", lambda d, old: hybrid_row(read(d, "hybrid"), old_variant if old else variant)),
    # rows25: bench_hybrid.py's resident, offload and hybrid rows at 25% (256-token prompt, 64 decode tokens)
    ("rows25 resident, tok/s", lambda d, old: run_median(read(d, "rows25"), r"resident")),
    ("rows25 offload 25%, tok/s", lambda d, old: hybrid_row(read(d, "rows25"), "=offload")),
    ("rows25 hybrid 25%, tok/s", lambda d, old: hybrid_row(read(d, "rows25"), old_variant if old else variant)),
    ("rows25 hand-off p50, us", lambda d, old: handoff_line(read(d, "rows25"))),
    ("hand-off round trip p50, us", lambda d, old: handoff_p50(read(d, "handoff"))),
    ("ensure 2,048 slots all hits, us", lambda d, old: ensure_us(read(d, "ensure"), 2048, 0)),
    ("ensure 2,048 slots 1 fetch, us", lambda d, old: ensure_us(read(d, "ensure"), 2048, 1)),
    ("ensure 23,197 slots all hits, us", lambda d, old: ensure_us(read(d, "ensure"), 23197, 0)),
    ("ensure 23,197 slots 1 fetch, us", lambda d, old: ensure_us(read(d, "ensure"), 23197, 1)),
    ("TTFT 1K resident, s", lambda d, old: ttft(read(d, "ttft_1k"), r"resident")),
    ("TTFT 1K offload 25%, s", lambda d, old: ttft(read(d, "ttft_1k"), r"offload 25%")),
    ("TTFT 1K hybrid 25%, s", lambda d, old: ttft(read(d, "ttft_1k"), r"hybrid")),
    ("TTFT 4K resident, s", lambda d, old: ttft(read(d, "ttft_4k"), r"resident")),
    ("TTFT 4K offload 25%, s", lambda d, old: ttft(read(d, "ttft_4k"), r"offload 25%")),
    ("TTFT 4K hybrid 25%, s", lambda d, old: ttft(read(d, "ttft_4k"), r"hybrid")),
]
cols = [arg.split("=", 1) for arg in sys.argv[1:]]
rows = [(name, [fn(d, col == "old") for col, d in cols]) for name, fn in METRICS]
rows = [(name, vals) for name, vals in rows if any(v is not None for v in vals)]
if not rows:
    print("(no headline figure found in the logs)")
    sys.exit(0)
head = f"{'figure':<34}" + "".join(f"{col:>12}" for col, _ in cols) + ("   new / old" if len(cols) == 2 else "")
print("\n" + head + "\n" + "-" * len(head))
for name, vals in rows:
    cells = "".join(f"{'-' if v is None else f'{v:.2f}':>12}" for v in vals)
    ratio = (f"{vals[1] / vals[0]:>12.3f}" if len(vals) == 2 and None not in vals and vals[0] else "")
    print(f"{name:<34}{cells}{ratio}")
PY
}

suites=${*:-tests}
[ "$suites" = all ] && suites="tests kernels engine hybrid prefill"
set -- $suites
while [ $# -gt 0 ]; do
  s=$1; shift
  case $s in
    tests)
      # the test files that import the openai or anthropic client at their top hold no gpu test (the HTTP APIs run
      # in CI); where the GPU machine lacks a package, those files are left out rather than failing to import
      skip=$(for pkg in openai anthropic; do python3 -c "import $pkg" 2>/dev/null \
        || grep -rlE "^(import|from) $pkg( |$)" tests --include='*.py' | sed 's/^/--ignore=/'; done | sort -u | tr '\n' ' ')
      # -v: each test's result is logged as it ends, so a run cut by its time limit still names its failures;
      # --durations: the slowest tests, to keep the suite inside one device call
      pyt="python3 -m pytest -v -rfE --durations=25 -p no:cacheprovider -m gpu"
      w=${TESTS_WORKERS:-1}
      # Files of many slow tests that share no module fixture: on one worker each they held the suite past a
      # device call's 10 minutes (test_slot_cache_gpu, test_prefetch_gpu). With TESTS_WORKERS >= 4 and the whole
      # suite, they run beside the rest, a test at a time over TESTS_SPREAD_WORKERS (2) pytest-xdist workers
      # (--dist load), and every other file whole on one of the other workers (loadfile: module fixtures built
      # once). (xdist's loadgroup would say this in one run, but does not group under pytest 9.2: xdist #1386.)
      spread="tests/kernels/test_slot_cache_gpu.py tests/gpu_worker/test_prefetch_gpu.py"
      sw=${TESTS_SPREAD_WORKERS:-2}
      if [ "$w" -ge 4 ] && [ -z "${TESTS_ARGS:-}" ] && [ "$sw" -ge 1 ] && [ "$sw" -lt "$w" ]; then
        ign=$(for f in $spread; do printf -- "--ignore=%s " "$f"; done)
        ( run tests_spread "${TESTS_TIMEOUT:-590}" $pyt -n "$sw" --dist load $spread; exit $status ) &
        spid=$!
        run tests "${TESTS_TIMEOUT:-590}" $pyt -n $((w - sw)) --dist loadfile $skip $ign tests/
        wait "$spid" || status=1
      else
        par=$([ "$w" -gt 1 ] && echo "-n $w --dist ${TESTS_DIST:-loadfile}")
        run tests "${TESTS_TIMEOUT:-590}" $pyt $par $skip ${TESTS_ARGS:-tests/}
      fi
      grep -hE "^(FAILED|ERROR) tests/|^=+ .* in [0-9.]+s" "$OUT"/tests.log "$OUT"/tests_spread.log 2>/dev/null \
        | cut -c1-240 | tail -n 30
      ;;
    grammar)
      run grammar_test "$T" python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu_worker/test_engine_grammar.py
      gtok=${GRAMMAR_TOKENIZER:-.whl/qwen3-tokenizer.json}
      run grammar_bench "$T" python3 bench/bench_grammar.py --device cuda --preset qwen3-30b-a3b --context 1024 \
        $([ -f "$gtok" ] && echo "--grammar-tokenizer $gtok --tokenizer $gtok --vocab 151936")
      grep "^|" "$OUT/grammar_bench.log"
      ;;
    batch)
      # throughput at batch: bench_engine.py --batch B (aggregate tok/s, HBM roofline) for B in BATCH_SIZES, the
      # default expert compute (resident: gemv to 128 pairs, grouped GEMMs above, in the CUDA graphs for bf16 on
      # Hopper+), eager beside graphs (--graphs both), and gemv forced (CUDA graphs at any B)
      for b in ${BATCH_SIZES:-1 4 16}; do
        for ec in auto gemv; do
          [ "$b" -eq 1 ] && [ $ec = gemv ] && continue       # (auto is gemv at batch 1)
          g=on; [ "$b" -gt 1 ] && [ $ec = auto ] && g=both
          run batch_${b}_$ec "$T" python3 bench/bench_engine.py --preset "${BATCH_PRESET:-qwen3-30b-a3b}" --runs 2 \
            --prompt-tokens 1024 --decode-tokens 64 --batch "$b" --fractions "${BATCH_FRACTIONS:-}" \
            --expert-compute $ec --graphs $g
        done
      done
      grep -hE "^(resident|offload)" "$OUT"/batch_*.log | cut -c1-200
      ;;
    prefix)
      # the paged KV cache's prefix cache and long contexts: TTFT of a 500-token turn on a 32K history (prefix cache
      # off / on), decode at 1K / 32K / 128K contexts, batch 16 at 8K on a pool that fixed 128K rows would not fit;
      # resident, then offload at 25% (PREFIX_PARTS: some of resident next gptoss offload; default resident offload)
      pargs="--preset qwen3-30b-a3b-128k --device cuda --history-tokens 32768 --turn-tokens 500 --kv-cache-gib 12.5"
      [ -n "${PREFIX_PROFILE:-}" ] && pargs="$pargs --profile"        # one more turn of each kind, its kernels
      parts=" ${PREFIX_PARTS:-resident offload} "
      # one layer's prefill attention of the hit's 516-token chunk against a 4K chunk, each SDPA backend (~20 s)
      run prefill_attention 60 python3 bench/bench_prefill_attention.py --chunks 516,4096 --context 33284
      case $parts in *" resident "*)
        run prefix_resident "${PREFIX_LIMIT:-270}" python3 bench/bench_prefix_cache.py $pargs --moe-strategy resident \
          --decode-contexts 1024,32768,131008 --batch 16 --batch-context 8192 --batch-max-context 131072 \
          --json-out "$OUT/prefix_resident.json";; esac
      case $parts in *" next "*)           # Qwen3-Next: a hit resumes the linear layers' kept states
        run prefix_next "${PREFIX_LIMIT:-300}" python3 bench/bench_prefix_cache.py --preset qwen3-next-80b-a3b \
          --expert-format nvfp4 --device cuda --history-tokens 32768 --turn-tokens 500 --kv-cache-gib 8 \
          --moe-strategy resident --runs 2 --decode-contexts "" ${PREFIX_PROFILE:+--profile} \
          --json-out "$OUT/prefix_next.json";; esac
      case $parts in *" gptoss "*)         # gpt-oss-120b at 128K: YaRN x32, the sliding layers keeping their window
        run prefix_gptoss "${PREFIX_LIMIT:-300}" python3 bench/bench_prefix_cache.py --preset gpt-oss-120b \
          --device cuda --history-tokens 32768 --turn-tokens 500 --kv-cache-gib 5 --moe-strategy resident --runs 2 \
          --decode-contexts 1024,32768,131008 ${PREFIX_PROFILE:+--profile} --json-out "$OUT/prefix_gptoss.json";; esac
      case $parts in *" offload "*)
        run prefix_offload "${PREFIX_LIMIT:-340}" python3 bench/bench_prefix_cache.py $pargs --moe-strategy offload \
          --moe-cache-size 0.25 --runs 2 --decode-contexts 1024,32768,131008 --routing "${PREFIX_ROUTING:-zipf:1.0}" \
          --json-out "$OUT/prefix_offload.json";; esac
      grep -hE "^(turn|decode|batch|profile of|[A-Z][a-zA-Z]+Experts)" "$OUT"/prefix_*.log | cut -c1-220
      grep -E "^ +[0-9]+ " "$OUT/prefill_attention.log" | cut -c1-160
      ;;
    kernels)
      run ensure "$T" python3 -m ftexpert.kernels.slot_cache.bench --reps 200 --slots 64,2048,18432,23197
      run attention "$T" python3 bench/bench_decode_attention.py
      run moe_decode "$T" python3 bench/bench_moe_decode.py
      run moe_decode_quant "$T" python3 bench/bench_moe_decode_quant.py --json-out "$OUT/moe_decode_quant.json"
      tail -n 8 "$OUT/ensure.log"; echo; tail -n 8 "$OUT/attention.log"; echo; grep "^|" "$OUT/moe_decode.log" | head -n 30
      echo; grep "^|" "$OUT/moe_decode_quant.log" | head -n 24
      summary this="$OUT"
      ;;
    tuning)
      # block sizes of the decode kernels, measured where they are not yet tuned: the 4-bit MoE GEMV's GemvBlocks sweep
      # (its block shapes and the scale a group's sum, quant_group_sum) at gpt-oss-120b's (MXFP4, 4 of 128 experts,
      # H = I = 2880) and qwen3-next-80b-a3b's shapes (NVFP4, 10 of 512, H 2048, I 512); the decode attention's
      # num_stages at T = 1 and 4, 1K and 32K contexts                                          (~3 min)
      run quant_gptoss 120 python3 bench/bench_moe_decode_quant.py --formats mxfp4 --experts 128 --hidden 2880 \
        --inter 2880 --top-k 4 --tokens 1 --sweep --skip-dequant --json-out "$OUT/quant_gptoss.json"
      run quant_next 120 python3 bench/bench_moe_decode_quant.py --formats nvfp4 --experts 512 --hidden 2048 \
        --inter 512 --top-k 10 --tokens 1 --sweep --skip-dequant --json-out "$OUT/quant_next.json"
      # the dense projections' LinearBlocks sweep at qwen3-next-80b-a3b's and gpt-oss-120b's shapes (linear_gemv is
      # the decode step's largest kernel there: docs/QWEN3_NEXT.md's profile)
      run linear_arch 150 python3 bench/bench_moe_decode.py --linear-only --tokens 1 --sweep --linear-shapes \
        next_in_qkvz=12288x2048,next_ba=64x2048,next_out=2048x4096,next_attn_qkv=9216x2048,next_attn_o=2048x4096,next_shared_gu=1024x2048,next_shared_down=2048x512,next_router=512x2048,oss_qkv=5120x2880,oss_o=2880x4096,oss_router=128x2880 \
        --json-out "$OUT/linear_arch.json"
      run attn_stages 120 python3 bench/bench_decode_attention.py --no-sdpa --sweep-set stages --tokens 1,4 \
        --contexts 1024,32768 --json-out "$OUT/attn_stages.json"
      grep -hE "^(mxfp4|nvfp4|bf16) " "$OUT"/quant_gptoss.log "$OUT"/quant_next.log | cut -c1-120
      grep -hE "^\| (mxfp4|nvfp4|bf16)" "$OUT"/quant_gptoss.log "$OUT"/quant_next.log | cut -c1-160
      grep -E "best sweep variant|^\| linear" "$OUT/linear_arch.log" | cut -c1-160
      tail -n 6 "$OUT/attn_stages.log" | cut -c1-160
      ;;
    quant_mma)
      # the tensor-core gate/up and down (GemvBlocks.quant_mma, quant_mma_down), in parts (MMA_PARTS, default "sweep
      # tests": one device call): sweep, both beside the defaults at gpt-oss-120b's and qwen3-next's shapes; tests,
      # their GPU tests (against the reference at those shapes, deterministic, in a CUDA graph); engine,
      # qwen3-next-80b-a3b's resident decode with the defaults, then with both on the tensor cores (a call of its own)
      mparts=" ${MMA_PARTS:-sweep tests} "
      if [[ $mparts == *" sweep "* ]]; then
        run mma_gptoss 150 python3 bench/bench_moe_decode_quant.py --formats mxfp4 --experts 128 --hidden 2880 \
          --inter 2880 --top-k 4 --tokens 1,4 --mma-sweep --skip-dequant --json-out "$OUT/mma_gptoss.json"
        run mma_next 150 python3 bench/bench_moe_decode_quant.py --formats nvfp4 --experts 512 --hidden 2048 \
          --inter 512 --top-k 10 --tokens 1,4 --mma-sweep --skip-dequant --json-out "$OUT/mma_next.json"
        grep -hE "^(mxfp4|nvfp4) " "$OUT"/mma_gptoss.log "$OUT"/mma_next.log | cut -c1-130
      fi
      if [[ $mparts == *" tests "* ]]; then
        run mma_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_decode_quant_mma.py
        tail -n 3 "$OUT/mma_tests.log"
      fi
      if [[ $mparts == *" engine "* ]]; then
        for q in default mma; do
          run "mma_engine_$q" 280 python3 bench/bench_engine.py --preset qwen3-next-80b-a3b --expert-format nvfp4 \
            --runs 2 --prompt-tokens 1024 --decode-tokens 256 --fractions "" --quant-gemv $q
          grep -hE "^(backend|resident)" "$OUT/mma_engine_$q.log" | cut -c1-200
        done
      fi
      ;;
    quant_profile)
      # ncu needs a machine whose runtime lets it read the counters (the device notes: Firecracker yes, gVisor no);
      # --clock-control none leaves the clocks as the other suites run them
      for shape in next gptoss; do
        run quant_sass_$shape 150 python3 bench/profile_quant_gemv.py --shape $shape --sass
        if command -v ncu >/dev/null; then
          # the sections, then the raw stall metrics in a run of their own (a metric this ncu lacks fails only that one)
          ncu_run() { run "quant_ncu_${shape}_$1" 150 ncu --clock-control none -k regex:quant_kernel --launch-skip 8 \
            --launch-count 4 "${@:2}" --csv --page details --log-file "$OUT/ncu_${shape}_$1.csv" \
            python3 bench/profile_quant_gemv.py --shape $shape --calls 12
            python3 bench/profile_quant_gemv.py --summarize-ncu "$OUT/ncu_${shape}_$1.csv" | tee "$OUT/ncu_${shape}_$1.txt"; }
          ncu_run sections --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          ncu_run stalls --metrics "$(python3 bench/profile_quant_gemv.py --metrics-list)"
        else
          echo "   (no ncu on PATH: the counters are left out)"
        fi
        grep -h "loop" "$OUT/quant_sass_$shape.log" | cut -c1-200
      done
      ;;
    engine)
      run engine "$T" python3 bench/bench_engine.py --runs 3 --prompt-tokens 1024 --decode-tokens 256 \
        --fractions 0.1,0.25,0.5
      run ttft_1k "$T" python3 bench/bench_prefill.py --runs 3 --prompt-tokens 1024 --chunks 4096 --fractions ""
      grep -v "^ " "$OUT/engine.log" | tail -n 6 | cut -c1-200
      summary this="$OUT"
      ;;
    hybrid)
      run hybrid "$T" python3 bench/bench_hybrid.py --runs 3 --decode-tokens 64 --handoff-calls 200 --no-resident \
        --rounds 3 --variants "$HYBRID_VARIANT" --json-out "$OUT/bench_hybrid.json"
      run handoff 200 python3 bench/bench_handoff.py --mode gpu --client-cpu 0
      run cpu_experts 200 python3 bench/bench_cpu_experts.py --isas
      grep -E "^(B_pcie|at the same|hand-off)" "$OUT/hybrid.log" | cut -c1-200
      tail -n 8 "$OUT/handoff.log" | cut -c1-160; echo; tail -n 12 "$OUT/cpu_experts.log" | cut -c1-160
      summary this="$OUT"
      ;;
    cpu)
      for k in 8 1; do
        run "cpu_experts_$k" 120 python3 bench/bench_cpu_experts.py --format int4-g128,mxfp4,nvfp4 --batches 1,4 \
          --repeats 50 --experts 64 --experts-per-call "$k"
      done
      run cpu_phases 120 python3 bench/bench_cpu_phases.py --format mxfp4,nvfp4 --batches 1,4 --experts-per-call 1,8
      grep -hE "^(int4|mxfp4|nvfp4) +native|DRAM.*native" "$OUT"/cpu_experts_*.log | cut -c1-160
      tail -n 9 "$OUT/cpu_phases.log" | cut -c1-160
      ;;
    cpu_ab)
      # the CPU expert kernel's phases, OLD_TREE against this one, CPU_AB_ROUNDS rounds (default 3) interleaved (the
      # host's memory is shared with other work: its rate moves between runs, so a side-by-side needs turns); each
      # tree runs its own bench_cpu_phases.py, which builds that tree's library (OLD_TREE: a whole `git archive` of
      # src and bench, as bench_cpu_phases.py imports bench_cpu_experts.py beside it)
      old=${1:?cpu_ab needs OLD_TREE: a directory with an older checkout}; shift
      old=$(cd "$old" && pwd) || { status=1; continue; }
      new=$PWD
      for r in $(seq 1 "${CPU_AB_ROUNDS:-3}"); do
        for side in old new; do
          tree=$([ $side = old ] && echo "$old" || echo "$new"); cd "$tree"; use_tree "$tree"
          run "cpu_ab_${side}_$r" 90 python3 bench/bench_cpu_phases.py --format mxfp4,nvfp4 --batches 1,4 \
            --experts-per-call 1,8 --repeats 100
        done
      done
      cd "$new"; use_tree "$new"
      for side in old new; do
        echo "-- $side (rounds 1..${CPU_AB_ROUNDS:-3}): format, experts, batch, call us"
        for f in "$OUT"/cpu_ab_${side}_*.log; do
          grep -E "^(mxfp4|nvfp4) " "$f" | awk '{printf "%s %s %s %s; ", $1, $3, $4, $5} END {print ""}'
        done
      done
      ;;
    prefill)
      run ttft_1k "$T" python3 bench/bench_prefill.py --runs 3 --prompt-tokens 1024 --chunks 4096 --fractions 0.25 \
        ${PREFILL_VARIANTS:+--variants "$PREFILL_VARIANTS"}
      run ttft_4k "$T" python3 bench/bench_prefill.py --runs 2 --prompt-tokens 4096 --chunks 4096 --fractions 0.25 \
        ${PREFILL_VARIANTS:+--variants "$PREFILL_VARIANTS"}
      tail -n 6 "$OUT/ttft_1k.log" | cut -c1-160; tail -n 6 "$OUT/ttft_4k.log" | cut -c1-160
      summary this="$OUT"
      ;;
    routing)
      tr=trace:src/ftexpert/workload/data/qwen3-30b-a3b-routing.trace
      run engine_routing "$T" python3 bench/bench_engine.py --runs 2 --prompt-tokens 1024 --decode-tokens 128 \
        --fractions 0.1,0.25,0.5 --routing "zipf:1.0,$tr"
      for r in zipf:1.0 "$tr"; do
        n=hybrid_$(echo "${r%%:*}" | tr -cd 'a-z')
        run "$n" "${HYBRID_LIMIT:-150}" python3 bench/bench_hybrid.py --runs 2 --decode-tokens 64 --handoff-calls 200 --no-resident \
          --variants "$HYBRID_VARIANT" --routing "$r" --json-out "$OUT/$n.json"
      done
      grep -E "^(backend|resident|offload)" "$OUT/engine_routing.log" | cut -c1-160
      grep -hE "^(B_pcie|row: )" "$OUT"/hybrid_zipf.log "$OUT"/hybrid_trace.log | cut -c1-200
      ;;
    workload)
      w=$(mktemp -d); m=${WORKLOAD_MINUTES:-6.5}
      ( run train_olmoe 590 python3 -m ftexpert.workload.train_moe --shape olmoe-routing --out "$w/olmoe-routing" \
          --minutes "$m" --curve-points 6 --device cuda
        run routing_olmoe 200 python3 -m ftexpert.workload.routing --model "$w/olmoe-routing" --tokens 16384 --device cuda \
          --json "$w/olmoe-routing.json" ) &
      ( run train_qwen3 590 python3 -m ftexpert.workload.train_moe --shape qwen3-30b-a3b-routing --out "$w/qwen3-routing" \
          --minutes "$m" --curve-points 6 --device cuda
        run routing_qwen3 200 python3 -m ftexpert.workload.routing --model "$w/qwen3-routing" --tokens 16384 --device cuda \
          --json "$w/qwen3-30b-a3b-routing.json"
        run trace_qwen3 120 python3 -m ftexpert.workload.routing --model "$w/qwen3-routing" --tokens 4096 --device cuda \
          --trace "$w/qwen3-30b-a3b-routing.trace" ) &
      run train_default 590 python3 -m ftexpert.workload.train_moe --shape default --out "$w/default-moe" \
        --tokens "${DEFAULT_TOKENS:-40000000}" --device cuda
      wait
      for d in olmoe-routing qwen3-routing default-moe; do cp "$w/$d/ft_workload.json" "$w/$d.meta.json" 2>/dev/null; done
      mv "$OUT"/train_*.log "$OUT"/routing_*.log "$OUT"/trace_*.log "$w"/ 2>/dev/null
      rm -rf "$w/olmoe-routing" "$w/qwen3-routing"
      tar -C "$w" -cJf "$OUT/workload.tar.xz" . && ls -la "$w" "$OUT/workload.tar.xz"
      grep -hE "^(shape|trained|--minutes|curve)" "$w"/train_*.log | cut -c1-220
      grep -hE "^ *(layer|all) " "$w"/routing_*.log | cut -c1-220
      ;;
    prefetch)
      # the lookahead prefetch at the qwen3-30b-a3b shape on the trained trace (its recorded candidates stand in for
      # the predictor): off against auto (the default), interleaved run by run in one process. One part a device
      # call (PREFETCH_PART):
      #   bf16, nvfp4  offload at 10 / 25 / 50% caches, batch PREFETCH_BATCH (1, or 4)           (~5 min each)
      #   hybrid       offload and hybrid split at 25%, off and auto (bench_hybrid --rounds 2), bf16 then nvfp4, batch 1;
      #                each row a fresh backend, so auto starts cold each row: 128 decode tokens a run   (~6 min)
      #   budgets      the fixed budgets 2 / 4 / 8 (on) and measure against off, bf16, 25 / 50%, batch 1   (~5 min)
      #   long         nvfp4 at 25%, a 32K-token context (--prompt-tokens 32768), batch 1       (~4 min)
      #   zipf         nvfp4 at 10 / 25 / 50% with zipf:1.0 routing: the preset's random routers predict nothing
      #                better than chance (the lower bound: auto must not lose)                 (~4 min)
      #   gptoss       gpt-oss-120b (MXFP4), offload at 10 / 25 / 50%, its own router on the random weights (~6 min)
      tr=trace:src/ftexpert/workload/data/qwen3-30b-a3b-routing.trace
      n=${PREFETCH_TOKENS:-64}      # decode tokens of each run
      b=${PREFETCH_BATCH:-1}
      part=${PREFETCH_PART:-bf16}
      case "$part" in
        bf16|nvfp4)
          run "prefetch_${part}_b$b" "${PREFETCH_LIMIT:-$T}" python3 bench/bench_prefetch.py --routing "$tr" \
            --expert-format "$part" --fractions 0.1,0.25,0.5 --batch "$b" --prefetch "${PREFETCH_MODES:-off,auto}" --runs 2 \
            --decode-tokens "$n" --warmup-tokens 96 ${PREFETCH_PROFILE:+--profile $PREFETCH_PROFILE} \
            --record-probe "$OUT/prefetch_probe_${part}_b$b.json"
          grep -hE "^(\||auto:|graphs:|steps:)" "$OUT/prefetch_${part}_b$b.log" | cut -c1-260 ;;
        hybrid)
          for f in bf16 nvfp4; do
            run "prefetch_hybrid_$f" "${PREFETCH_HYBRID_LIMIT:-270}" python3 bench/bench_hybrid.py --expert-format "$f" \
              --runs 2 --rounds 2 --decode-tokens "${PREFETCH_HYBRID_TOKENS:-128}" --handoff-calls 200 --no-resident \
              --variants "=offload,$HYBRID_VARIANT" --prefetch-budgets auto --routing "$tr" \
              --json-out "$OUT/prefetch_hybrid_$f.json"
            grep -hE "^(B_pcie|row: )" "$OUT/prefetch_hybrid_$f.log" | cut -c1-200
          done ;;
        budgets)
          run prefetch_budgets "${PREFETCH_LIMIT:-$T}" python3 bench/bench_prefetch.py --routing "$tr" --fractions 0.25,0.5 \
            --batch "$b" --prefetch off,auto,on,measure --prefetch-budget 2,4,8 --runs 2 --decode-tokens "$n"
          grep -hE "^(\||auto:)" "$OUT/prefetch_budgets.log" | cut -c1-260 ;;
        long|zipf|gptoss)
          case "$part" in
            long) pargs="--expert-format nvfp4 --routing $tr --fractions 0.25 --prompt-tokens 32768" ;;
            zipf) pargs="--expert-format nvfp4 --routing zipf:1.0 --fractions 0.1,0.25,0.5" ;;
            gptoss) pargs="--preset gpt-oss-120b --routing model --fractions 0.1,0.25,0.5" ;;
          esac
          run "prefetch_${part}_b$b" "${PREFETCH_LIMIT:-$T}" python3 bench/bench_prefetch.py $pargs --batch "$b" \
            --prefetch "${PREFETCH_MODES:-off,auto}" --runs 2 --decode-tokens "$n" --warmup-tokens 96 \
            --record-probe "$OUT/prefetch_probe_${part}_b$b.json"
          grep -hE "^(\||auto:|graphs:|steps:)" "$OUT/prefetch_${part}_b$b.log" | cut -c1-260 ;;
        *) echo "PREFETCH_PART=$part: bf16, nvfp4, hybrid, budgets, long, zipf or gptoss" >&2; status=2 ;;
      esac
      ;;
    prefetch_trained)
      # a trained olmoe-routing checkpoint (PREFETCH_TRAIN_MINUTES), its predictions at budgets 1, 2, 4, 8, and the
      # served path: ft serve prefetch off against on, 60 cold prompts, 256 greedy tokens (needs the openai wheel)
      w=$(mktemp -d)
      run train_olmoe 590 python3 -m ftexpert.workload.train_moe --shape olmoe-routing --out "$w/olmoe-routing" \
        --minutes "${PREFETCH_TRAIN_MINUTES:-3}" --device cuda
      run prefetch_quality 240 python3 bench/prefetch_quality.py --model "$w/olmoe-routing" --device cuda --cache 0.25 \
        --budgets 1,2,4,8
      run prefetch_served 300 python3 bench/prefetch_served.py --model "$w/olmoe-routing" --device cuda \
        --moe-cache-size 256 --prompts 60 --max-tokens 256 --json "$OUT/prefetch_served.json"
      tail -n 12 "$OUT/prefetch_quality.log" | cut -c1-200; tail -n 2 "$OUT/prefetch_served.log" | cut -c1-200
      ;;
    architectures)
      # Qwen3-Next (NVFP4 experts) and gpt-oss-120b (MXFP4): resident and offload at 10 / 25 / 50%, TTFT at 1K and 32K
      aparts=" ${ARCH_PARTS:-next gptoss ttft} "
      afr=${ARCH_FRACTIONS-0.1,0.25,0.5}
      aprof=$([ "${ARCH_PROFILE:-0}" -gt 0 ] && echo "--profile $ARCH_PROFILE")
      # ARCH_OLD=DIR: the same engine rows in an older checkout too, after each of this tree's (one call, one machine)
      arch_old=${ARCH_OLD:+$(cd "$ARCH_OLD" && pwd)}
      arch_row() {   # NAME ARGS...: the row in this tree, then (ARCH_OLD) in the old one, whose log gets an _old suffix
        local name=$1; shift
        run "$name" "$T" python3 bench/bench_engine.py --runs 2 --prompt-tokens 1024 --decode-tokens 256 \
          --fractions "$afr" "$@" $aprof
        if [ -n "$arch_old" ]; then
          ( cd "$arch_old" && use_tree "$arch_old" && run "${name}_old" "$T" python3 bench/bench_engine.py --runs 2 \
              --prompt-tokens 1024 --decode-tokens 256 --fractions "$afr" "$@"; exit $status ) || status=1
        fi
      }
      case $aparts in *" next "*) arch_row next_engine --preset qwen3-next-80b-a3b --expert-format nvfp4;; esac
      case $aparts in *" gptoss "*) arch_row gptoss_engine --preset gpt-oss-120b;; esac
      case $aparts in *" ttft "*)
        run next_ttft "$T" python3 bench/bench_prefill.py --preset qwen3-next-80b-a3b --expert-format nvfp4 --runs 2 \
          --prompt-tokens 32768 --chunks 4096 --fractions ""
        run qwen3_ttft "$T" python3 bench/bench_prefill.py --preset qwen3-30b-a3b --runs 2 --prompt-tokens 32768 \
          --chunks 4096 --fractions "";; esac
      for f in next_engine next_engine_old gptoss_engine gptoss_engine_old; do
        [ -f "$OUT/$f.log" ] && { echo "-- $f"; grep -hE "^(backend|resident|offload|profile:)" "$OUT/$f.log" | cut -c1-200; }
      done
      tail -n 4 "$OUT/next_ttft.log" "$OUT/qwen3_ttft.log" 2>/dev/null | cut -c1-200
      ;;
    soak)
      # ft soak on the GPU (SOAK_S, default 540: one device command is limited to 10 minutes), hybrid, a float32
      # copy of the embedded model (bfloat16 answers vary with the batch, docs/SOAK.md), CPU-worker kills every
      # 180 s and one GPU-worker kill; the report (json, png, server log) in $OUT/soak
      m=$(mktemp -d)/default-f32
      python3 - "$m" <<'PY'
import json, pathlib, shutil, sys
from safetensors.torch import load_file, save_file
from gpu_worker.api import DEFAULT_MODEL_DIR
out = pathlib.Path(sys.argv[1]); shutil.copytree(DEFAULT_MODEL_DIR, out)
save_file({k: v.float() for k, v in load_file(out / "model.safetensors").items()}, out / "model.safetensors")
cfg = json.loads((out / "config.json").read_text()); cfg["torch_dtype"] = "float32"
(out / "config.json").write_text(json.dumps(cfg, indent=2))
PY
      s_=${SOAK_S:-540}
      run soak $((s_ + 50)) python3 -m ftexpert.coordinator.cli soak --duration-s "$s_" --concurrency 16 \
        --serve-args "--model $m --device cuda --moe-strategy hybrid --num-cpu-workers 1 --max-running-requests 16" \
        --kill-cpu-worker-at-s 60 --kill-cpu-worker-every-s 180 --kill-gpu-worker-at-s $((s_ / 2)) --out "$OUT/soak"
      tail -n 25 "$OUT/soak.log" | cut -c1-200
      ;;
    compare)
      # One call, both trees, the same measurement: 128 decode tokens and 3 runs (engine), 64 tokens (hybrid),
      # 2,000 hand-off calls, 100 kernel replays, a 1K prompt resident. Each command has its own limit so that the
      # suite stays under ~9 minutes; a bench cut off by its limit keeps the per-run lines printed so far.
      old=${1:?compare needs OLD_TREE: a directory with an older checkout}; shift
      lim() { echo $(( $1 * ${COMPARE_STRETCH:-100} / 100 )); }     # COMPARE_STRETCH=150: every limit x 1.5
      old=$(cd "$old" && pwd) || { status=1; continue; }
      new=$PWD
      export HYBRID_VARIANT OLD_HYBRID_VARIANT=${OLD_HYBRID_VARIANT:-$HYBRID_VARIANT}
      mkdir -p "$OUT/old" "$OUT/new"
      parts=" ${COMPARE_PARTS:-rows25 ensure} "     # a subset: e.g. COMPARE_PARTS=engine
      want() { case $parts in *" $1 "*) return 0;; *) return 1;; esac; }
      for side in old new; do
        # a bench cut off by its limit leaves its expert store behind (named by its pid: nothing reclaims it), and
        # the next side would find /dev/shm full: nothing else runs here, so both sides start from an empty one
        rm -f /dev/shm/ft-experts-*
        if [ $side = old ]; then
          cd "$old"; base=$OUT; OUT=$base/old; use_tree "$old"
          # an older tree's flags: where the copy kernel was one of several decode copy modes, it is asked for
          want engine && run engine $(lim 110) python3 bench/bench_engine.py --runs 3 --prompt-tokens 1024 \
            --decode-tokens 128 --fractions 0.25,0.5 $(grep -q -- --offload-copy bench/bench_engine.py && echo --offload-copy kernel)
          want hybrid && run hybrid $(lim 80) python3 bench/bench_hybrid.py --runs 3 --decode-tokens 64 --handoff-calls 200 \
            --no-resident --variants "$OLD_HYBRID_VARIANT" --json-out "$OUT/bench_hybrid.json"
        else
          cd "$new"; OUT=$base/new; use_tree "$new"
          want engine && run engine $(lim 110) python3 bench/bench_engine.py --runs 3 --prompt-tokens 1024 \
            --decode-tokens 128 --fractions 0.25,0.5
          want hybrid && run hybrid $(lim 80) python3 bench/bench_hybrid.py --runs 3 --decode-tokens 64 --handoff-calls 200 \
            --no-resident --variants "$HYBRID_VARIANT" --json-out "$OUT/bench_hybrid.json"
        fi
        # resident, offload 25% and hybrid 25% over one host store fill (the hybrid bench's own rows, both trees)
        want rows25 && run rows25 $(lim 235) python3 bench/bench_hybrid.py --runs 3 --decode-tokens 64 \
          --handoff-calls 200 --variants "=offload,$([ $side = old ] && echo "$OLD_HYBRID_VARIANT" || echo "$HYBRID_VARIANT")" \
          --json-out "$OUT/bench_hybrid_rows25.json"
        want handoff && run handoff $(lim 25) python3 bench/bench_handoff.py --mode gpu --client-cpu 0 --calls 2000
        want ensure && run ensure $(lim 20) python3 -m "$(mod kernels.slot_cache.bench)" --reps 100 --slots 2048,23197
        want ttft_1k && run ttft_1k $(lim 35) python3 bench/bench_prefill.py --runs 3 --prompt-tokens 1024 --chunks 4096 \
          --fractions ""
        OUT=$base
      done
      cd "$new"; use_tree "$new"
      summary old="$OUT/old" new="$OUT/new" | tee "$OUT/compare.txt"
      ;;
    peer_build)
      # llama.cpp's llama-bench for the side-by-side benchmark; a build cut by the limit keeps its objects: run the
      # suite again on the warm machine and ninja goes on from there
      PACK="$OUT" run peer_build "${PEER_BUILD_LIMIT:-590}" bash bench/peer_llamacpp/build.sh cuda
      tail -n 12 "$OUT/peer_build.log" | cut -c1-200
      ;;
    peer)
      # llama.cpp and this project side by side (docs/PEERS.md), one table last
      if [ ! -x bench/peer_llamacpp/bin/cuda/llama-bench ] && compgen -G "bench/peer_llamacpp/dist/peer_bin_cuda.tar.xz.part-*" >/dev/null; then
        mkdir -p bench/peer_llamacpp/bin && cat bench/peer_llamacpp/dist/peer_bin_cuda.tar.xz.part-* | tar -xJf - -C bench/peer_llamacpp/bin
      fi
      rm -f /dev/shm/ft-experts-*
      # the CUDA 13 runtime and cuBLAS the binary loads: the toolkit's, else those of torch's nvidia wheels (a
      # binary built elsewhere, build.sh CUDA_ROOT=..., finds them here as one built on this machine does)
      nvlib=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)
      export LD_LIBRARY_PATH=/usr/local/cuda/lib64${nvlib:+:$nvlib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      run peer "${PEER_LIMIT:-595}" python3 bench/peer_llamacpp/run_peer.py --jobs "${PEER_JOBS:-qwen3-30b-a3b:bf16}" \
        --parts "${PEER_PARTS:-theirs,engine,hybrid,prefill}" --out "$OUT" --total-s "${PEER_TOTAL_S:-570}" ${PEER_MERGE:+--merge $PEER_MERGE} ${PEER_ARGS:-}
      grep -E "^\[run_peer" "$OUT/peer.log" | tail -n 12 | cut -c1-200
      cat "$OUT/peer_table.md" 2>/dev/null
      ;;
    *)
      echo "unknown suite: $s (tests, kernels, tuning, engine, hybrid, cpu, cpu_ab OLD_TREE, prefill, routing, workload, prefetch, prefetch_trained, architectures, soak, peer_build, peer, batch, prefix, all, compare OLD_TREE)" >&2; status=2
      ;;
  esac
done
exit $status
