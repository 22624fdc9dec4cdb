"""`HybridExperts`: the `hybrid` and `cpu` expert backends. Misses are split between PCIe fetches and
the CPU expert pool; hits run on the GPU slot pool.

forward(layer, x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H], per layer:
  1. ensure (kernels/slot_cache) with the device policy tensor (fraction f, rounding, selection,
     promotion; `set_policy` changes it live): hits and fetched misses get slot ids, the rest -1.
  2. Readback (one D2H, one sync): copy plan, routes, router ids and weights, hidden states.
  3. Hand-off: the triples (token, ORIGINAL expert id, weight) of the routes at -1 and the hidden
     states go to the CPU workers that own those experts, before anything else is queued.
  4. Copies of the planned experts on the copy stream (after every GEMM already queued).
  5. Expert GEMMs over the slot ids on the compute stream, after the copies' event. A route at -1
     reads slot 0 with weight 0: the pool starts zeroed and only ever receives real experts, so
     every slot holds finite values and such a route adds exactly 0 (never 0 * NaN).
  6. Join: the workers' fp32 partial sums [T, H] are added; one output cast.
A CPU share that is not answered (worker dead, deadline missed, error) is fetched instead: ensure
again for those experts with fraction 1.0 (a normal ensure call, so the cache state stays
consistent), copy, GEMM, add. The backend then runs as offload (nothing to the CPU) until every
worker is back: the supervisor restarts it (the store in shared memory survives), `CpuPool.poll`
re-admits it once its channel answers. Forwards with more than `cpu_max_tokens` tokens, or more
triples than a channel holds, run as offload too.
`cpu` = this backend with f = 0 and promotion off (docs/HYBRID.md says why the pool stays).
Legend: T tokens, K top-k, H hidden, E experts per layer, S slots per pool, n triples.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from gpu_worker.models.expert_layout import unpack_experts
from gpu_worker.models.resident_experts import MODES, gathered_expert_ffn, grouped_expert_ffn
from gpu_worker.offload import HostExperts
from kernels.slot_cache import SlotCache, ensure, set_policy

from .cpu_pool import CpuPool, Share
from .readback import LayerPlan, Readback
from .stats import HybridStats, StreamTimer, WorkerCounters

log = logging.getLogger("ft.hybrid")

STRATEGIES = ("hybrid", "cpu", "offload")     # what set_policy(strategy=...) may switch between
IGNORED_POLICY_FIELDS = ("moe_prefetch", "moe_prefetch_budget")   # no prefetch in this backend yet


class HybridExperts:
    """Expert backend over a GPU slot pool and a CPU expert pool; see the module docstring."""

    def __init__(self, host: HostExperts, num_slots: int, device: torch.device | str, pool: CpuPool, *,
                 strategy: str = "hybrid", fetch_fraction: float = 0.5, fetch_round: str = "min-wait",
                 fetch_select: str = "recency", promote: bool = True, seed: int = 0, per_layer: bool = False,
                 mode: str = "auto", gather_max_pairs: int = 32, cpu_max_tokens: int = 512,
                 owns_host: bool = True, owns_pool: bool = True):
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        self.host, self.pool, self.layout = host, pool, host.layout
        self.owns_host, self.owns_pool = owns_host, owns_pool
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.mode, self.gather_max_pairs = mode, gather_max_pairs
        self.cpu_max_tokens = min(cpu_max_tokens, pool.t_max)
        self.cache = SlotCache.create(self.num_layers, self.num_experts, num_slots, device=self.device,
                                      per_layer=per_layer)
        # slots: [S_total, N]; zeroed once so that every slot always holds finite values (step 5)
        self.slots = torch.zeros(self.cache.total_slots, self.layout.expert_numel, dtype=self.layout.dtype,
                                 device=self.device)
        self.w13, self.w2 = unpack_experts(self.slots, self.layout)
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self._queued = torch.cuda.Event() if self.on_cuda else None
        self.readback = Readback(self.device, self._hidden_dtype())
        self._partial = torch.empty(0, dtype=torch.float32, pin_memory=self.on_cuda)   # [T, H] CPU sums
        self.stats = HybridStats(cpu_workers={m.name: WorkerCounters() for m in pool.members})
        self.timer = StreamTimer(self.on_cuda, self.stats)
        self.strategy = "hybrid"
        self.policy = {}
        self.set_policy(strategy=strategy, fetch_fraction=fetch_fraction, fetch_round=fetch_round,
                        fetch_select=fetch_select, promote=promote, seed=seed)
        self.degraded = False             # a worker failed: offload until every one is back
        self.fetch_fraction_source = "given"   # or "flag", "default", "profile:PATH" (build.py)

    def _hidden_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.pool.hidden_dtype == "bfloat16" else torch.float32

    # -- policy -----------------------------------------------------------------------------------
    def set_policy(self, *, strategy: str | None = None, fetch_fraction: float | None = None,
                   fetch_round: str | None = None, fetch_select: str | None = None, promote: bool | None = None,
                   seed: int | None = None, cpu_shares: dict[str, float] | None = None,
                   **other) -> None:
        """Change the split live (the coordinator's engine.set_policy lands here): writes the device policy
        tensor that ensure reads. strategy: hybrid (f as given), cpu (f = 0, no promotion), offload (f = 1)."""
        unknown = sorted(set(other) - set(IGNORED_POLICY_FIELDS))
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(unknown)}")
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"this backend switches between {', '.join(STRATEGIES)}, not {strategy!r} "
                             f"(resident needs a restart with --moe-strategy resident)")
        p = dict(self.policy)
        for key, value in (("strategy", strategy), ("fetch_fraction", fetch_fraction), ("fetch_round", fetch_round),
                           ("fetch_select", fetch_select), ("promote", promote), ("seed", seed)):
            if value is not None:
                p[key] = value
        fraction, promote_now = float(p["fetch_fraction"]), bool(p["promote"])
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fetch_fraction must be within [0, 1], got {fraction!r}")
        if p["strategy"] == "cpu":
            fraction, promote_now = 0.0, False
        elif p["strategy"] == "offload":
            fraction = 1.0
        set_policy(self.cache, fetch_fraction=fraction, round_mode=p["fetch_round"], select=p["fetch_select"],
                   promote=promote_now, seed=int(p["seed"]))          # validates before writing
        if cpu_shares and self.pool is not None:
            self.pool.set_shares(cpu_shares)                          # the tuner's per-worker split
        self.policy = p
        self.strategy = p["strategy"]

    @property
    def cpu_active(self) -> bool:
        """Whether the next forward hands misses to the CPU pool."""
        return not self.degraded and self.strategy != "offload"

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        T, K = topk_ids.shape
        if self.degraded:
            self._readmit()
        st = self.stats
        st.calls += 1
        st.routed_pairs += T * K
        ids = topk_ids.to(torch.int32)                                    # [T, K] the router's expert ids
        routes = ids.clone()                                              # [T, K] -> slot ids or -1
        to_cpu = self.cpu_active and self.pool.fits(T, T * K) and T <= self.cpu_max_tokens
        p = self.policy
        if to_cpu:
            ensure(self.cache, layer_idx, routes, use_device_policy=True, check_ids=False)
        else:                                                             # offload: fetch every miss
            st.offload_calls_total += 1
            ensure(self.cache, layer_idx, routes, fetch_fraction=1.0, round_mode=p["fetch_round"],
                   select=p["fetch_select"], promote=bool(p["promote"]), check_ids=False)
        t0 = time.perf_counter()
        plan = self.readback.read(self.cache, max_plan=min(self.num_experts, T * K), ids=ids,
                                  routes=routes if to_cpu else None, weights=topk_weights if to_cpu else None,
                                  x=x if to_cpu else None)
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
            st.handoff_s_total += time.perf_counter() - t0
        self._copy(layer_idx, plan)
        if triples is None:
            return self._gemm(x, routes, topk_weights, skip=False)
        valid = routes >= 0
        out = self._gemm(x, torch.where(valid, routes, 0), torch.where(valid, topk_weights, 0.0),
                         skip=triples[0].size == T * K)
        return self._join(layer_idx, x, out, triples, shares).to(x.dtype)

    def _gemm(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, skip: bool) -> torch.Tensor:
        """sum_k w_k * FFN_{slot_k}(x) over slot ids [T, K] -> [T, H] (x.dtype); zeros when `skip`."""
        if skip:
            return torch.zeros_like(x)
        mode = self.mode
        if mode == "auto":
            mode = "gather" if self.on_cuda and slot_ids.numel() <= self.gather_max_pairs else "grouped"
        ffn = gathered_expert_ffn if mode == "gather" else grouped_expert_ffn
        return ffn(x, slot_ids, weights, self.w13, self.w2)

    def _copy(self, layer_idx: int, plan: LayerPlan) -> None:
        """Execute the copy plan: host store -> slots, on the copy stream after every queued GEMM."""
        n = plan.num_copies
        if n == 0:
            return
        st = self.stats
        st.experts_fetched_total += n
        st.copy_bytes_total += n * self.layout.expert_nbytes
        host_layer = self.host.layers[layer_idx]                                   # [E, N] host
        if not self.on_cuda:
            t0 = time.perf_counter()
            for d, s in zip(plan.dst, plan.src):
                self.slots[d].copy_(host_layer[s])
            t1 = time.perf_counter()
            self.timer.add("copy_time_s_total", t0, t1)
            self.timer.add("gpu_wait_for_copy_s_total", t0, t1)      # the host copies before it computes
            return
        compute = torch.cuda.current_stream(self.device)
        self._queued.record(compute)             # every GEMM already queued reads its slot first
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._queued)     # (the wait takes the event as recorded now)
            start = self.timer.mark(self.copy_stream)
            for d, s in zip(plan.dst, plan.src):
                self.slots[d].copy_(host_layer[s], non_blocking=True)
            done = self.timer.mark(self.copy_stream)
        self.timer.add("copy_time_s_total", start, done)
        wait_from = self.timer.mark(compute)
        compute.wait_event(done)
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
        st = self.stats
        for share in shares:
            if share.error is None:
                wc = st.cpu_workers[share.member.name]
                wc.experts_total += share.num_experts
                wc.triples_total += share.rows.size
                wc.time_s_total += share.compute_s
                st.cpu_experts_total += share.num_experts
                st.cpu_triples_total += share.rows.size
                st.cpu_expert_time_s_total += share.compute_s
        total = out.float() + partial.to(self.device, non_blocking=True)     # [T, H] fp32
        for share in failed:
            st.cpu_workers[share.member.name].failures_total += 1
            total = self._fetch_instead(layer_idx, x, total, *(t[share.rows] for t in triples))
        if failed:
            self._degrade()
        return total

    def _fetch_instead(self, layer_idx: int, x: torch.Tensor, total: torch.Tensor, token: np.ndarray,
                       expert: np.ndarray, weight: np.ndarray) -> torch.Tensor:
        """A CPU share nobody answered (token, expert, weight [n]): fetch its experts (ensure with fraction
        1.0, a normal call that keeps the cache state consistent), copy, GEMM, add into total [T, H] fp32."""
        tokens = torch.from_numpy(token.astype(np.int64)).to(self.device)                  # [n]
        routes = torch.from_numpy(expert.reshape(-1, 1)).to(self.device)                    # [n, 1] expert ids
        weights = torch.from_numpy(weight.reshape(-1, 1)).to(self.device)                   # [n, 1]
        ensure(self.cache, layer_idx, routes, fetch_fraction=1.0, round_mode="min-wait",
               select=self.policy["fetch_select"], promote=False, check_ids=False)         # -> slot ids
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
        if self.pool.all_serving:
            self.degraded = False
            self.stats.readmissions_total += 1
            log.warning("CPU pool complete again: back to %s", self.strategy)

    # -- telemetry and life cycle -----------------------------------------------------------------
    def counters(self) -> dict:
        """Cumulative counters (HybridStats fields) with the event timings resolved; plus the mode."""
        self.timer.resolve()
        out = self.stats.as_dict()
        out["mode"] = "offload (CPU pool down)" if self.degraded else self.strategy
        return out

    @property
    def expert_nbytes(self) -> int:
        return self.layout.expert_nbytes

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def close(self) -> None:
        if self.owns_pool:
            self.pool.close()
        if self.owns_host:
            self.host.close()
        self.owns_pool = self.owns_host = False
