"""Bandwidth measurements behind `ft bench bw`, and the profile file they go to (docs/POLICY.md schema).

- `copy_bandwidth`: host -> device copies of one expert from the expert store (CUDA events; the store
  pinned with cudaHostRegister, as the offload and hybrid backends use it). On a CPU device: host
  memcpy store -> slot buffer, which is what those backends' "fetch" is there.
- `cpu_pool_bandwidth`: the CPU pool's expert throughput through real `ft worker cpu` processes, the
  real kernel and the real channel: 1 token x top_k distinct experts per call (a decode step's CPU
  share), weight bytes / round-trip time. Each call reads experts no earlier call touched recently.
- `write_profile_entry`: merge one entry, keyed on (gpu_name, dtype, H, I), into the profile JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
import uuid

import numpy as np
import torch

from cpu_expert_pool.channel import CpuPoolClient, create_worker_channel
from cpu_expert_pool.proc import CpuWorkerProc
from cpu_expert_pool.split import ExpertSplit
from proto.expert_store import ExpertStore

from .cpu_pool import channel_hidden_dtype

WARMUP_CALLS = 10
WARMUP_S = 0.3              # CPU pool: calls for at least this long before timing (a fresh worker settles)
WORKER_START_TIMEOUT_S = 120.0
CALL_DEADLINE_S = 30.0


@dataclasses.dataclass
class Measurement:
    gb_s: float              # median
    p10_gb_s: float          # the slow tail (10th percentile of bandwidth)
    calls: int


def bench_store(hidden: int, intermediate: int, dtype: torch.dtype, store_bytes: int, min_experts: int,
                seed: int = 0) -> ExpertStore:
    """A one-layer store of random experts, at least `store_bytes` (beyond the last-level cache)."""
    expert_bytes = 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()
    num = max(min_experts, -(-store_bytes // expert_bytes))
    store = ExpertStore.create(f"ft-benchbw-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=1, num_experts=num,
                               hidden=hidden, intermediate=intermediate, dtype=dtype, config_hash="bench-bw")
    gen = torch.Generator().manual_seed(seed)
    view = store.layer_view(0)                                                    # [E, N]
    for start in range(0, num, 64):
        view[start:start + 64].normal_(0.0, 0.02, generator=gen)
    store.mark_ready()
    return store


def _measurement(nbytes: int, seconds: list[float]) -> Measurement:
    return Measurement(nbytes / statistics.median(seconds) / 1e9,
                       nbytes / float(np.percentile(seconds, 90)) / 1e9, len(seconds))


def copy_bandwidth(store: ExpertStore, device: torch.device, calls: int) -> Measurement:
    """One expert a copy, store -> device buffer, cycling through the store's experts."""
    layer = store.layer_view(0)                                                   # [E, N]
    dst = torch.empty(layer.shape[1], dtype=layer.dtype, device=device)          # [N]
    times = []
    if device.type == "cuda":
        store.pin_for_cuda()
        stream = torch.cuda.current_stream(device)
        for i in range(WARMUP_CALLS + calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(layer[i % layer.shape[0]], non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for i in range(WARMUP_CALLS + calls):
            t0 = time.perf_counter()
            dst.copy_(layer[i % layer.shape[0]])
            times.append(time.perf_counter() - t0)
    return _measurement(store.expert_bytes, times[WARMUP_CALLS:])


def cpu_pool_bandwidth(store: ExpertStore, *, top_k: int, calls: int, num_workers: int, worker_flags: list[str],
                       log_dir: str | None = None) -> Measurement:
    """Round trips of 1-token calls over top_k distinct experts of layer 0 through `num_workers` real
    workers of their own (channels "<store>.bw<w>", so a pool serving the store is left alone)."""
    num = store.num_experts
    split = ExpertSplit.contiguous(1, num, num_workers)
    hidden_dtype = channel_hidden_dtype(store.dtype)
    segments, procs, clients = [], [], []
    try:
        for w in range(num_workers):
            name = f"{store.name}.bw{w}"
            segments.append(create_worker_channel(name, t_max=1, hidden=store.shape.hidden, max_triples=top_k,
                                                  hidden_dtype=hidden_dtype))
            log_path = os.path.join(log_dir, f"bench-bw-worker{w}.log") if log_dir else None
            procs.append(CpuWorkerProc(store_name=store.name, channel_name=name, worker_index=w,
                                       num_workers=num_workers, extra_args=worker_flags, log_path=log_path).start())
            clients.append(CpuPoolClient(name))
        for client in clients:
            client.wait_for_worker(timeout_s=WORKER_START_TIMEOUT_S)
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(1, store.shape.hidden, generator=gen).to(torch.bfloat16 if hidden_dtype == "bfloat16"
                                                                       else torch.float32)
        weight = np.full(top_k, 1.0 / top_k, dtype=np.float32)
        token = np.zeros(top_k, dtype=np.int32)
        times = []
        warm_until = time.perf_counter() + WARMUP_S
        i = 0
        while len(times) < calls:
            experts = ((i * top_k + np.arange(top_k)) % num).astype(np.int32)   # fresh experts every call
            i += 1
            parts = split.split_triples(0, experts)
            t0 = time.perf_counter()
            for client, rows in zip(clients, parts):
                if rows.size:
                    client.submit(0, hidden, (token[rows], experts[rows], weight[rows]))   # layer 0
            for client, rows in zip(clients, parts):
                if rows.size:
                    client.wait(0, deadline_s=CALL_DEADLINE_S)
            if i > WARMUP_CALLS and t0 > warm_until:
                times.append(time.perf_counter() - t0)
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            proc.stop(timeout_s=10)
        for seg in segments:
            seg.close()
            seg.unlink()
    return _measurement(top_k * store.expert_bytes, times)


def write_profile_entry(path: str, entry: dict) -> dict:
    """Merge `entry` (gpu_name, dtype, hidden_size, intermediate_size, pcie_gb_s, cpu_gb_s, ...) into the
    profile at `path`, replacing an entry with the same key; atomic. Returns the whole document."""
    doc: dict = {"entries": []}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                old = json.load(fh)
            if isinstance(old, dict) and isinstance(old.get("entries"), list):
                doc = old
        except (OSError, ValueError):
            pass                                       # unreadable: replaced by a fresh document
    key = ("gpu_name", "dtype", "hidden_size", "intermediate_size")
    doc["entries"] = [e for e in doc["entries"]
                      if not (isinstance(e, dict) and all(e.get(k, doc.get(k)) == entry[k] for k in key))]
    doc["entries"].append(entry)
    doc["gpu_name"] = entry["gpu_name"]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".benchbw-", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return doc
