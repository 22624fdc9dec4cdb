"""CPU <-> CPU process round trip through the shared-memory doorbell (CpuPoolClient <-> a real worker).

Starts one `ft worker cpu` process (standalone, on its own cores) and times client.call() round trips:
submit (copy a 1-token hidden state, ring request_seq) -> the worker sees it, answers (zeroes the
1-token partial sum; no expert work) -> done_seq -> the client sees it. Expert compute time is what
bench_cpu_experts.py measures. Reports p50/p99 over --calls calls while the worker is hot,
then a few calls after idle gaps longer than its hot window (the back-off's cost).

    python bench/bench_handoff.py                 # 10,000 hot calls
    python bench/bench_handoff.py --client-cpu 0  # pin this process; the worker gets the other CPUs
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cpu_expert_pool.channel import CpuPoolClient, create_worker_channel  # noqa: E402
from cpu_expert_pool.proc import CpuWorkerProc  # noqa: E402
from proto.expert_store import ExpertStore  # noqa: E402

HIDDEN = 2048              # qwen3-30b-a3b hidden size: the request carries one such row
TINY_INTERMEDIATE = 8      # the experts are never computed here (0 triples): keep the store small
START_TIMEOUT_S = 120
DEADLINE_S = 5.0


def percentiles_us(samples_ns: list[int]) -> tuple[float, float, float]:
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), float(arr.max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--client-cpu", type=int, default=None,
                        help="pin this process to this CPU and keep it out of the worker's set")
    parser.add_argument("--hot-ms", type=float, default=50.0, help="worker: spin this long after a request")
    parser.add_argument("--cold-calls", type=int, default=20, help="calls after an idle gap > hot window")
    args = parser.parse_args()

    tag = os.getpid()
    store = ExpertStore.create(f"ft-bench-handoff-{tag}", num_layers=2, num_experts=8, hidden=HIDDEN,
                               intermediate=TINY_INTERMEDIATE, dtype=torch.bfloat16, config_hash="bench")
    for layer in range(2):
        store.write_layer(layer, torch.zeros(8, store.shape.expert_numel, dtype=torch.bfloat16))
    store.mark_ready()
    chan_name = f"ft-bench-handoff-{tag}.cpu0"
    chan = create_worker_channel(chan_name, t_max=16, hidden=HIDDEN, max_triples=128)
    worker_args = ["--threads", "1", "--hot-ms", str(args.hot_ms), "--no-warmup", "--log-level", "WARNING"]
    if args.client_cpu is not None:
        os.sched_setaffinity(0, {args.client_cpu})
        worker_args += ["--reserve-cpus", str(args.client_cpu)]
        env = dict(os.environ)
    else:
        env = None
    proc = CpuWorkerProc(store_name=store.name, channel_name=chan_name, extra_args=worker_args, env=env)
    # The child inherits our affinity; widen it back so the worker's own plan can use its cores.
    if args.client_cpu is not None:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        proc.start()
        os.sched_setaffinity(0, {args.client_cpu})
    else:
        proc.start()
    client = CpuPoolClient(chan_name)
    rows = []
    try:
        client.wait_for_worker(timeout_s=START_TIMEOUT_S)
        hidden = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)                             # [1, H]
        empty = (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), torch.empty(0))
        samples = []
        for i in range(args.warmup + args.calls):
            t0 = time.perf_counter_ns()
            client.call(i % 2, hidden, empty, deadline_s=DEADLINE_S)     # layers alternate slots
            dt = time.perf_counter_ns() - t0
            if i >= args.warmup:
                samples.append(dt)
        rows.append(("1 token, 0 triples, worker hot", len(samples), *percentiles_us(samples)))
        cold = []
        for i in range(args.cold_calls):
            time.sleep(args.hot_ms / 1e3 + 0.05)
            t0 = time.perf_counter_ns()
            client.call(i % 2, hidden, empty, deadline_s=DEADLINE_S)
            cold.append(time.perf_counter_ns() - t0)
        if cold:
            rows.append((f"1 token, 0 triples, after {args.hot_ms + 50:.0f} ms idle", len(cold),
                         *percentiles_us(cold)))
    finally:
        client.close()
        proc.stop(timeout_s=10)
        chan.close()
        chan.unlink()
        store.close()
        store.unlink()
    print(f"worker pid {proc.pid}, client affinity {sorted(os.sched_getaffinity(0))}, {os.cpu_count()} CPUs")
    print()
    print(f"{'round trip':<42} {'calls':>6} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for label, n, p50, p99, worst in rows:
        print(f"{label:<42} {n:>6} {p50:>8.1f} {p99:>8.1f} {worst:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
