"""The host hand-off of `HybridExperts`: one layer with one readback, the CPU share submitted to the pool and
joined on the host; and what both paths share when a CPU share is lost (fetch it instead, degrade, re-admit).

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
add; the backend then runs as offload until every worker is back (`_readmit`).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ftexpert.gpu_worker.backends.offload.slot_pool import prefill_prefetch_layer
from ftexpert.kernels.slot_cache import ensure, prefetch_ensure

from ftexpert.gpu_worker.backends.hybrid.cpu_pool import Share
from ftexpert.gpu_worker.backends.hybrid.readback import LayerPlan

log = logging.getLogger("ft.hybrid")


class HostHandoff:
    """HybridExperts' host path (a mixin: the state is HybridExperts')."""

    def _forward_host(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor,
                      topk_weights: torch.Tensor, to_cpu: bool, ready: torch.cuda.Event | None) -> torch.Tensor:
        """One layer on the host path (the module docstring); `ready`: the event of the experts a prefill
        prefetched for this layer, waited for after this layer's own copies are queued."""
        T, K = ids.shape
        st = self.stats
        st.calls += 1
        st.routed_pairs += T * K
        p = self.policy
        if to_cpu and self._unsplit_policy is not None:                   # split: min-wait where nothing splits
            ensure(self.cache, layer_idx, routes, check_ids=False, **self._unsplit_policy)
        elif to_cpu:
            ensure(self.cache, layer_idx, routes, use_device_policy=True, check_ids=False)
        else:                                                             # offload: fetch every miss
            st.offload_calls_total += 1
            ensure(self.cache, layer_idx, routes, fetch_fraction=1.0, round_mode=p["fetch_round"],
                   promote=bool(p["promote"]), check_ids=False)
        # A prefill chunk run as offload routes to most experts of every layer: stream the next layer's (a
        # low-priority prefetch of all of them, never evicting this layer's) behind this layer's own copies.
        nxt = (prefill_prefetch_layer(layer_idx, T * K, self.num_experts, self.num_layers, self.gather_max_pairs)
               if not to_cpu and self.prefill_prefetch else None)
        prefetch_len = self._candidates.numel()
        if nxt is not None:
            prefetch_ensure(self.cache, nxt, self._candidates, self._candidates.numel(), check_ids=False)
        elif self._after_ensure(layer_idx):      # the lookahead's install for the next layer (decode-sized calls)
            nxt, prefetch_len = layer_idx + 1, self.lookahead.settings.budget
        self._verify(layer_idx, ids, routes)
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
                    db = self._device_doorbells.get(share.member.index)
                    if db is not None:
                        self._resync.add(db)
            st.handoff_s_total += time.perf_counter() - t0
        self._copy(layer_idx, plan, prefetch_layer=nxt)
        self._wait_prefetched(ready)
        if triples is None:
            return self._gemm(x, routes, topk_weights, skip=False)
        out = self._gemm_gpu_routes(x, routes, topk_weights, skip=triples[0].size == T * K)
        total = self._join(layer_idx, x, out, triples, shares).to(x.dtype)
        while self._resync:                          # after the join: nothing of theirs in flight
            self._resync.pop().sync_sequence()
        return total

    def _queue_prefetch_copies(self, host_layer: torch.Tensor, dsts: list[int], srcs: list[int]) -> None:
        """The prefetch part of a plan, on the current (copy) stream; a seam for the GPU test that delays it."""
        for d, s in zip(dsts, srcs):
            self.slots[d].copy_(host_layer[s], non_blocking=True)

    def _copy(self, layer_idx: int, plan: LayerPlan, prefetch_layer: int | None = None) -> None:
        """Execute the copy plan: host store -> slots, on the copy stream after every queued GEMM; with
        `prefetch_layer`, then the plan's prefetch part (that layer's rows) behind it, which the compute
        stream does not wait for here: `forward` of that layer does (`_prefetched`)."""
        n, m = plan.num_copies, len(plan.prefetch_dst)
        if n == 0 and m == 0:
            return
        st = self.stats
        st.experts_fetched_total += n + m
        st.experts_prefetched_total += m
        st.copy_bytes_total += (n + m) * self.layout.expert_nbytes
        jobs = [(self.host.layers[layer_idx], plan.dst, plan.src)]                 # [E, N] host rows
        if m:
            jobs.append((self.host.layers[prefetch_layer], plan.prefetch_dst, plan.prefetch_src))
        if not self.on_cuda:
            t0 = time.perf_counter()
            for host_layer, dsts, srcs in jobs:
                for d, s in zip(dsts, srcs):
                    self.slots[d].copy_(host_layer[s])
            t1 = time.perf_counter()
            self.timer.add("copy_time_s_total", t0, t1)
            self.timer.add("gpu_wait_for_copy_s_total", t0, t1)      # the host copies before it computes
            if m:
                self._prefetched[prefetch_layer] = None              # (landed already: nothing to wait for)
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
                self._prefetched[prefetch_layer] = landed
        self.timer.add("copy_time_s_total", start, end)   # copy_bytes_total counts the prefetch too
        wait_from = self.timer.mark(compute)
        compute.wait_event(done)                 # this layer's experts; the prefetch runs on
        self.timer.add("gpu_wait_for_copy_s_total", wait_from, self.timer.mark(compute))

    def _join(self, layer_idx: int, x: torch.Tensor, out: torch.Tensor,
              triples: tuple[np.ndarray, np.ndarray, np.ndarray], shares: list[Share]) -> torch.Tensor:
        """out [T, H] (GPU part) + the CPU partial sums -> [T, H] fp32; failed shares are fetched here.

        triples: the layer's CPU share, (token [n] int32, expert id [n] int32, weight [n] fp32)."""
        T, H = x.shape
        gemm_done = self.timer.mark()
        if self._partial.numel() < T * H:
            self._partial = torch.empty(T * H, dtype=torch.float32, pin_memory=self.on_cuda)
        partial = self._partial[:T * H].view(T, H)                       # [T, H] fp32 host
        failed = self.pool.join(layer_idx, shares, out=partial)
        self.timer.add("gpu_wait_for_cpu_s_total", gemm_done, self.timer.mark())
        for share in shares:
            if share.error is None:
                self._count_cpu(share.member.name, share.num_experts, share.rows.size, share.compute_s)
        total = out.float() + partial.to(self.device, non_blocking=True)     # [T, H] fp32
        st = self.stats
        for share in failed:
            st.cpu_workers[share.member.name].failures_total += 1
            total = self._fetch_instead(layer_idx, x, total, *(t[share.rows] for t in triples))
        if failed:
            self._degrade()
        return total

    def _count_cpu(self, worker: str, experts: int, triples: int, seconds: float) -> None:
        """Fold an answered CPU share into the per-worker and total counters."""
        st = self.stats
        wc = st.cpu_workers[worker]
        wc.experts_total += experts
        wc.triples_total += triples
        wc.time_s_total += seconds
        st.cpu_experts_total += experts
        st.cpu_triples_total += triples
        st.cpu_expert_time_s_total += seconds

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
        y = self._gemm(x.index_select(0, tokens), routes, weights, skip=False)            # [n, H]
        self.stats.fallbacks_total += 1
        self.stats.fallback_experts_total += plan.num_copies
        return total.index_add(0, tokens, y.float())

    def _degrade(self) -> None:
        if not self.degraded:
            log.warning("CPU pool incomplete: running as offload (every miss fetched) until its workers are back")
        self.degraded = True

    def _readmit(self) -> None:
        for m in self.pool.poll():
            self.stats.cpu_workers[m.name].readmissions_total += 1
            db = self._device_doorbells.get(m.index)
            if db is not None:
                db.reset()                    # the client reconnected in poll(); clear the abort word
        if self.pool.all_serving:
            self.degraded = False
            self.stats.readmissions_total += 1
            log.warning("CPU pool complete again: back to %s", self.strategy)
