"""`HostPath`: the hybrid backend's host hand-off. One layer with one readback, the CPU share submitted to the pool
and joined on the host; a share that is lost is fetched instead.

Per layer (every forward on a CPU device, prefill chunks and eager larger calls on a CUDA GPU):
  1. ensure (kernels/slot_cache): hits and fetched misses get slot ids, the rest -1; a forward that does
     not fit the channels, or that runs while the pool is degraded, fetches every miss (offload).
  2. Readback (one D2H, one sync): copy plan, routes, router ids and weights, hidden states.
  3. The triples (token, ORIGINAL expert id, weight) of the routes at -1 and the hidden states go to
     the CPU workers that own those experts (CpuPool.submit), before anything else is queued.
  4. Copies of the planned experts on the copy stream (after every GEMM already queued).
  5. Expert GEMMs over the slot ids on the compute stream, after the copies' event.
  6. Join: the workers' fp32 partial sums [T, H] are added (CpuPool.join); one output cast.
A share that is not answered (worker dead, deadline missed, error) is fetched instead: ensure again for
those experts with fraction 1.0 (a normal ensure call, so the cache state stays consistent), copy, GEMM,
add; the backend is told (`degrade`) and runs as offload until every worker is back. A call that routes at least
num_experts pairs and is not decode-sized (a prefill chunk) run as offload streams the next layer's experts behind
its own copies (`prefill_prefetch`; the event they land on in the slot pool's `prefetched`).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ftexpert.gpu_worker.backends.offload.slot_pool import SlotPool, prefill_prefetch_layer
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout
from ftexpert.kernels.slot_cache import ensure, prefetch_ensure
from ftexpert.kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES

from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool, Share
from ftexpert.gpu_worker.backends.hybrid.doorbells import PoolDoorbells
from ftexpert.gpu_worker.backends.hybrid.readback import LayerPlan, Readback
from ftexpert.gpu_worker.backends.hybrid.slot_gemm import SlotGemm
from ftexpert.gpu_worker.backends.hybrid.split_policy import SplitPolicy
from ftexpert.gpu_worker.backends.hybrid.stats import HybridStats, StreamTimer


class HostPath:
    """The host hand-off of one hybrid backend (see the module docstring), over the backend's parts: its slot pool,
    the expert `layout`, the CPU `pool` and its `doorbells` (kept in step with the host-driven calls), the GEMMs
    `gemm`, the `policy`, the `stats` and `timer` it counts into; `copy_stream` (CUDA) the copies' stream.
    `degrade` is called when a CPU share was lost (fetched instead)."""

    def __init__(self, slot_pool: SlotPool, layout: ExpertLayout, pool: CpuPool, doorbells: PoolDoorbells,
                 gemm: SlotGemm, policy: SplitPolicy, stats: HybridStats, timer: StreamTimer, *,
                 copy_stream: "torch.cuda.Stream | None", degrade: Callable[[], None]):
        self.slot_pool, self.cache, self.slots = slot_pool, slot_pool.cache, slot_pool.slots
        self.host_layers = slot_pool.host_layers
        self.layout, self.pool, self.doorbells, self.gemm, self.policy = layout, pool, doorbells, gemm, policy
        self.stats, self.timer, self.copy_stream, self.degrade = stats, timer, copy_stream, degrade
        self.device, self.on_cuda = slot_pool.device, slot_pool.on_cuda
        self.num_layers, self.num_experts = self.cache.num_layers, self.cache.num_experts
        self._queued = torch.cuda.Event() if self.on_cuda else None
        # prefill chunks run as offload stream the next layer's experts behind their own
        self.prefill_prefetch = True
        self._candidates = torch.arange(min(self.num_experts, MAX_PREFETCH_CANDIDATES), dtype=torch.int64,
                                        device=self.device)
        self.readback = Readback(self.device, torch.bfloat16 if pool.hidden_dtype == "bfloat16" else torch.float32)
        self._partial = torch.empty(0, dtype=torch.float32, pin_memory=self.on_cuda)   # [T, H] CPU sums

    def forward(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor,
                topk_weights: torch.Tensor, to_cpu: bool, ready: torch.cuda.Event | None) -> torch.Tensor:
        """One layer on the host path (the module docstring); `ready`: the event of the experts a prefill
        prefetched for this layer, waited for after this layer's own copies are queued."""
        T, K = ids.shape
        st = self.stats
        st.calls += 1
        st.routed_pairs += T * K
        p = self.policy.policy
        if to_cpu and self.policy.unsplit is not None:                    # split: min-wait where nothing splits
            ensure(self.cache, layer_idx, routes, check_ids=False, **self.policy.unsplit)
        elif to_cpu:
            ensure(self.cache, layer_idx, routes, use_device_policy=True, check_ids=False)
        else:                                                             # offload: fetch every miss
            st.offload_calls_total += 1
            ensure(self.cache, layer_idx, routes, fetch_fraction=1.0, round_mode=p["fetch_round"],
                   promote=bool(p["promote"]), check_ids=False)
        # A prefill chunk run as offload routes to most experts of every layer: stream the next layer's (a
        # low-priority prefetch of all of them, never evicting this layer's) behind this layer's own copies.
        nxt = (prefill_prefetch_layer(layer_idx, T * K, self.num_experts, self.num_layers, self.gemm.gather_max_pairs)
               if not to_cpu and self.prefill_prefetch else None)
        prefetch_len = self._candidates.numel()
        if nxt is not None:
            prefetch_ensure(self.cache, nxt, self._candidates, self._candidates.numel(), check_ids=False)
        elif self.slot_pool.after_ensure(layer_idx):   # the lookahead's install for the next layer (decode-sized)
            nxt, prefetch_len = layer_idx + 1, self.slot_pool.lookahead.plan_length
        self.slot_pool.verify(layer_idx, ids, routes)
        t0 = time.perf_counter()
        plan = self.readback.read(self.cache, max_plan=min(self.num_experts, T * K), ids=ids,
                                  routes=routes if to_cpu else None, weights=topk_weights if to_cpu else None,
                                  x=x if to_cpu else None,
                                  prefetch_candidates=prefetch_len if nxt is not None else 0)
        st.expert_misses_total += plan.num_misses
        st.expert_hits_total += plan.num_distinct - plan.num_misses
        shares: list[Share] = []
        triples = None
        if to_cpu:
            cpu_rows = np.flatnonzero(plan.routes < 0)                    # [n] flat routes left to the CPU
            if cpu_rows.size:
                # (token, ORIGINAL expert id, weight): copies, so later readbacks cannot overwrite them
                triples = ((cpu_rows // K).astype(np.int32), plan.ids[cpu_rows], plan.weights[cpu_rows])
                shares = self.pool.submit(layer_idx, plan.hidden, *triples)
                for share in shares:             # the device doorbells' sequence copies are now behind
                    self.doorbells.note_host_call(share.member.index)
            st.handoff_s_total += time.perf_counter() - t0
        self._copy(layer_idx, plan, prefetch_layer=nxt)
        if ready is not None:           # the experts a prefill prefetched for this layer (timed as a copy wait)
            self.timer.wait_event(torch.cuda.current_stream(self.device), ready, "gpu_wait_for_copy_s_total")
        if triples is None:
            return self.gemm.ffn(x, routes, topk_weights, skip=False)
        out = self.gemm.ffn_gpu_routes(x, routes, topk_weights, skip=triples[0].size == T * K)
        total = self._join(layer_idx, x, out, triples, shares).to(x.dtype)
        self.doorbells.resync()                      # after the join: nothing of theirs in flight
        return total

    def _queue_prefetch_copies(self, host_layer: torch.Tensor, dsts: list[int], srcs: list[int]) -> None:
        """The prefetch part of a plan, on the current (copy) stream; a seam for the GPU test that delays it."""
        for d, s in zip(dsts, srcs):
            self.slots[d].copy_(host_layer[s], non_blocking=True)

    def _copy(self, layer_idx: int, plan: LayerPlan, prefetch_layer: int | None = None) -> None:
        """Execute the copy plan: host store -> slots, on the copy stream after every queued GEMM; with
        `prefetch_layer`, then the plan's prefetch part (that layer's rows) behind it, which the compute
        stream does not wait for here: the backend's forward of that layer does (the slot pool's `prefetched`)."""
        n, m = plan.num_copies, len(plan.prefetch_dst)
        if n == 0 and m == 0:
            return
        st = self.stats
        st.experts_fetched_total += n + m
        st.experts_prefetched_total += m
        st.copy_bytes_total += (n + m) * self.layout.expert_nbytes
        jobs = [(self.host_layers[layer_idx], plan.dst, plan.src)]                 # [E, N] host rows
        if m:
            jobs.append((self.host_layers[prefetch_layer], plan.prefetch_dst, plan.prefetch_src))
        if not self.on_cuda:
            t0 = time.perf_counter()
            for host_layer, dsts, srcs in jobs:
                for d, s in zip(dsts, srcs):
                    self.slots[d].copy_(host_layer[s])
            t1 = time.perf_counter()
            self.timer.add("copy_time_s_total", t0, t1)
            self.timer.add("gpu_wait_for_copy_s_total", t0, t1)      # the host copies before it computes
            if m:
                self.slot_pool.prefetched[prefetch_layer] = None     # (landed already: nothing to wait for)
            return
        compute = torch.cuda.current_stream(self.device)
        self._queued.record(compute)             # every GEMM already queued reads its slot first
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._queued)     # (the wait takes the event as recorded now)
            start = self.timer.mark(self.copy_stream)
            host_layer, dsts, srcs = jobs[0]
            for d, s in zip(dsts, srcs):
                self.slots[d].copy_(host_layer[s], non_blocking=True)
            done = end = self.timer.mark(self.copy_stream)
            if m:
                self._queue_prefetch_copies(*jobs[1])
                end = self.timer.mark(self.copy_stream)     # (timer events are reused once resolved: not waited on)
                landed = torch.cuda.Event()
                landed.record(self.copy_stream)
                self.slot_pool.prefetched[prefetch_layer] = landed
        self.timer.add("copy_time_s_total", start, end)   # copy_bytes_total counts the prefetch too
        self.timer.wait_event(compute, done, "gpu_wait_for_copy_s_total")   # this layer's experts; the prefetch runs on

    def _join(self, layer_idx: int, x: torch.Tensor, out: torch.Tensor,
              triples: tuple[np.ndarray, np.ndarray, np.ndarray], shares: list[Share]) -> torch.Tensor:
        """out [T, H] (GPU part) + the CPU partial sums -> [T, H] fp32; failed shares are fetched here.

        triples: the layer's CPU share, (token [n] int32, expert id [n] int32, weight [n] fp32)."""
        T, H = x.shape
        st = self.stats
        gemm_done = self.timer.mark()
        if self._partial.numel() < T * H:
            self._partial = torch.empty(T * H, dtype=torch.float32, pin_memory=self.on_cuda)
        partial = self._partial[:T * H].view(T, H)                       # [T, H] fp32 host
        failed = self.pool.join(layer_idx, shares, out=partial)
        self.timer.add("gpu_wait_for_cpu_s_total", gemm_done, self.timer.mark())
        for share in shares:
            if share.error is None:
                st.count_cpu(share.member.name, share.num_experts, share.rows.size, share.compute_s)
        total = out.float() + partial.to(self.device, non_blocking=True)     # [T, H] fp32
        for share in failed:
            st.cpu_workers[share.member.name].failures_total += 1
            total = self._fetch_instead(layer_idx, x, total, *(t[share.rows] for t in triples))
        if failed:
            self.degrade()
        return total

    def _fetch_instead(self, layer_idx: int, x: torch.Tensor, total: torch.Tensor, token: np.ndarray,
                       expert: np.ndarray, weight: np.ndarray) -> torch.Tensor:
        """A CPU share nobody answered (token, expert, weight [n]): fetch its experts (ensure with fraction
        1.0, a normal call that keeps the cache state consistent), copy, GEMM, add into total [T, H] fp32."""
        tokens = torch.from_numpy(token.astype(np.int64)).to(self.device)                  # [n]
        routes = torch.from_numpy(expert.reshape(-1, 1)).to(self.device)                    # [n, 1] expert ids
        weights = torch.from_numpy(weight.reshape(-1, 1)).to(self.device)                   # [n, 1]
        ensure(self.cache, layer_idx, routes, fetch_fraction=1.0, round_mode="min-wait",
               promote=False, check_ids=False)                                              # -> slot ids
        plan = self.readback.read(self.cache, max_plan=min(self.num_experts, token.size))
        self._copy(layer_idx, plan)
        y = self.gemm.ffn(x.index_select(0, tokens), routes, weights, skip=False)          # [n, H]
        self.stats.fallbacks_total += 1
        self.stats.fallback_experts_total += plan.num_copies
        return total.index_add(0, tokens, y.float())
