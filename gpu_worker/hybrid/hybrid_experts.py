"""`HybridExperts`: the `hybrid` and `cpu` expert backends. Misses are split between PCIe fetches and
the CPU expert pool; hits run on the GPU slot pool.

forward(layer, x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H], per layer:
  1. ensure (kernels/slot_cache) with the device policy tensor (fraction f, rounding, selection,
     promotion; `set_policy` changes it live): hits and fetched misses get slot ids, the rest -1.
  2. Readback (one D2H, one sync): copy plan, routes, router ids and weights, hidden states.
  3. Hand-off: the triples (token, ORIGINAL expert id, weight) of the routes at -1 and the hidden
     states go to the CPU workers that own those experts, before anything else is queued.
  4. Copies of the planned experts on the copy stream (after every GEMM already queued).
  5. Expert GEMMs over the slot ids on the compute stream, after the copies' event, with the mode
     rule of `ResidentExperts` (`pick_mode`). In the gemv mode (moe_gemv) a route at -1 is skipped
     and adds exactly 0. The gather and grouped modes read slot 0 with weight 0 instead: the pool
     starts zeroed and only ever receives real experts, so every slot holds finite values and such
     a route adds 0 too (never 0 * NaN); the sums are the same.
  6. Join: the workers' fp32 partial sums [T, H] are added; one output cast.
A CPU share that is not answered (worker dead, deadline missed, error) is fetched instead: ensure
again for those experts with fraction 1.0 (a normal ensure call, so the cache state stays
consistent), copy, GEMM, add. The backend then runs as offload (nothing to the CPU) until every
worker is back: the supervisor restarts it (the store in shared memory survives), `CpuPool.poll`
re-admits it once its channel answers. Forwards with more than `cpu_max_tokens` tokens, or more
triples than a channel holds, run as offload too; such a call whose routes cover at least `num_experts` pairs
and that is not decode-sized (a prefill chunk; also a large batch while the pool is down) streams the next
layer's experts behind its own copies, as `OffloadExperts` does (`prefill_prefetch`, the knob
FREETOKEN_PREFILL_PREFETCH / --prefill-prefetch, default on). With strategy `cpu` at start the engine keeps
prefill chunks of `cpu_max_tokens` (`preferred_prefill_chunk_tokens`), so that nothing is fetched.
handoff="stream" (opt-in; the default "auto" is "device" on a CUDA GPU, "host" elsewhere): steps 3 and 6 go through `StreamDoorbell`s (one per pool
member, each on its own side stream on CUDA) instead of submit/join: the hidden-state copy down, the
doorbell, the wait for the worker and the partial-sum copy up are enqueued on the GPU, the join is a
stream-ordered add; the host checks each call's validity (host-memory polling, no CUDA call) before
the layer returns, so a failed share is fetched instead exactly as in "host" (docs/HYBRID.md).
handoff="device": decode-sized forwards (T*K <= gather_max_pairs) make no host sync at all, so the
engine captures the decode step in a CUDA graph: ensure, the copy plan as a kernel (kernels/expert_copy,
on the side stream in the gemv mode), beside it per pool member one `ring` kernel (its triples and the
hidden states written into its registered channel, request_seq rung), the GEMMs, then one `join` kernel
per member (spin on done_seq, add the partial sums in place). A failed share cannot be fetched inside the graph: the join leaves
it out and raises a flag, later rings of the step do nothing, and after the step the engine asks
`step_end()`, which marks the worker failed and has the step re-run as offload (a decode step is
idempotent: the same K/V rows are rewritten). Eager calls (graph warm-ups, no graphs) check the
flag after the layer and redo it as offload at once. Larger forwards (prefill) take the host path.
`cpu` = this backend with f = 0 and promotion off (docs/HYBRID.md says why the pool stays).
Legend: T tokens, K top-k, H hidden, E experts per layer, S slots per pool, n triples.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.models.expert_layout import unpack_experts
from gpu_worker.models.resident_experts import GRAPH_SAFE_MODES, MODES, expert_ffn, pick_mode
from gpu_worker.offload import HostExperts
from gpu_worker.offload.offload_experts import (SlotPoolAudit, copy_then_ffn, eviction_settings,
                                                 prefill_prefetch_layer)
from kernels import expert_split
from kernels import handoff as kernels_handoff
from kernels.expert_copy import copy_plan
from kernels.impl import interpreted
from kernels.slot_cache import SlotCache, ensure, prefetch_ensure, set_policy
from kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES
from proto.knobs import KNOBS_BY_FIELD, env_setting

from proto.cpu_channel import WorkerDead, WorkerError, WorkerTimeout

from .cpu_pool import CpuPool, Share
from .device_doorbell import DeviceDoorbell
from .options import HANDOFF_CHOICES, resolve_handoff   # host / stream / device, and auto (resolved here)
from .readback import LayerPlan, Readback
from .stats import HybridStats, StreamTimer, WorkerCounters

if TYPE_CHECKING:
    from .stream_doorbell import StreamCall, StreamDoorbell

log = logging.getLogger("ft.hybrid")

STREAM_WAIT_SLACK_S = 5.0         # beyond the deadline, how long the host waits before aborting a call itself
RECONNECT_TIMEOUT_S = 1.0         # a re-admitted worker's channel, when its doorbell reconnects

STRATEGIES = ("hybrid", "cpu", "offload")     # what set_policy(strategy=...) may switch between
# What the device path counts on the GPU (kernels.handoff.count_call, in its order), folded into stats between steps.
DEVICE_COUNTERS = ("experts_fetched_total", "expert_misses_total", "calls", "offload_calls_total", "routed_pairs",
                   "expert_hits_total")
IGNORED_POLICY_FIELDS = ("moe_prefetch", "moe_prefetch_budget")   # no decode prefetch in this backend yet


class HybridExperts(SlotPoolAudit):
    """Expert backend over a GPU slot pool and a CPU expert pool; see the module docstring."""

    def __init__(self, host: HostExperts, num_slots: int, device: torch.device | str, pool: CpuPool, *,
                 strategy: str = "hybrid", fetch_fraction: float = 0.5,
                 fetch_round: str = KNOBS_BY_FIELD["fetch_round"].default,
                 fetch_select: str = KNOBS_BY_FIELD["fetch_select"].default, promote: bool = True, seed: int = 0, per_layer: bool = False,
                 mode: str = "auto", gather_max_pairs: int = 32, cpu_max_tokens: int = 512,
                 owns_host: bool = True, owns_pool: bool = True, handoff: str = "auto",
                 overlap_copy: bool = True, split_copy: bool = True, prefill_prefetch: bool | None = None,
                 freq_weight: int | None = None, freq_half_life: int | None = None):
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        self.host, self.pool, self.layout = host, pool, host.layout
        self.owns_host, self.owns_pool = owns_host, owns_pool
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.mode, self.gather_max_pairs = mode, gather_max_pairs
        self.kernel_impl = "auto"     # moe_gemv: Triton on CUDA, reference on CPU ("triton": tests)
        self.cpu_max_tokens = min(cpu_max_tokens, pool.t_max)
        self.cache = SlotCache.create(self.num_layers, self.num_experts, num_slots, device=self.device,
                                      per_layer=per_layer,     # None: the FREETOKEN_EVICTION_FREQ_* knobs
                                      **eviction_settings(freq_weight, freq_half_life))
        # slots: [S_total + 1, N]; zeroed once so that every slot always holds finite values (step 5). The last
        # row, outside the cache, is the split slot: the GPU's channels of the expert split under fetch_round
        # "split" (kernels/expert_split; device hand-off only).
        self.split_slot = self.cache.total_slots
        self.slots = torch.zeros(self.cache.total_slots + 1, self.layout.expert_numel, dtype=self.layout.dtype,
                                 device=self.device)
        self._split_desc = torch.tensor([-1, 0], dtype=torch.int32, device=self.device)   # expert, limit c
        self._split_counts = torch.zeros(expert_split.COUNTS_LEN, dtype=torch.int64, device=self.device)
        self.w13, self.w2 = unpack_experts(self.slots, self.layout)
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.split_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None   # the split copy
        # device hand-off, gemv mode: the plan copy on copy_stream beside the hits' GEMMs (copy_then_ffn)
        self.overlap_copy = overlap_copy
        self.split_copy = split_copy            # the plan copy in two parts, w13 then w2 (copy_then_ffn)
        self._queued = torch.cuda.Event() if self.on_cuda else None
        # prefill chunks run as offload (more than cpu_max_tokens tokens) stream the next layer's experts
        # behind their own (None: the knob, default on); layer -> the event after its prefetched experts' copies
        if prefill_prefetch is None:
            prefill_prefetch = env_setting("prefill_prefetch") == "on"
        self.prefill_prefetch = bool(prefill_prefetch)
        self._prefetched: dict[int, torch.cuda.Event | None] = {}
        self._candidates = torch.arange(min(self.num_experts, MAX_PREFETCH_CANDIDATES), dtype=torch.int64,
                                        device=self.device)
        self.readback = Readback(self.device, self._hidden_dtype())
        self._partial = torch.empty(0, dtype=torch.float32, pin_memory=self.on_cuda)   # [T, H] CPU sums
        self.stats = HybridStats(cpu_workers={m.name: WorkerCounters() for m in pool.members})
        self.timer = StreamTimer(self.on_cuda, self.stats)
        self.strategy = "hybrid"
        self.policy = {}
        self.set_policy(strategy=strategy, fetch_fraction=fetch_fraction, fetch_round=fetch_round,
                        fetch_select=fetch_select, promote=promote, seed=seed)
        self.degraded = False             # a worker failed: offload until every one is back
        self.fetch_fraction_source = "given"   # or "flag", "default", "profile:PATH" (attached_backends.py)
        self.handoff = "host"
        self._doorbells: dict[int, StreamDoorbell] = {}        # pool member index -> its doorbell
        self._handoff_streams: dict[int, torch.cuda.Stream] = {}
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # pinned (ints [2n], weights [n])
        # handoff="device": one DeviceDoorbell per member, one failure flag for all, the owner map on the
        # device, and the device path's own counters (no host sync): DEVICE_COUNTERS.
        self._device_doorbells: dict[int, DeviceDoorbell] = {}
        self._resync: set[DeviceDoorbell] = set()         # doorbells whose channel took host-driven calls
        self._doorbell_epoch = 0                          # graph_key: graphs hold the doorbells' addresses
        self._hold_degraded = False                       # a failed device step's re-run must not re-admit
        self._in_step = False                             # between step_begin and step_end (a decode step)
        self._device_fail = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._owner = torch.from_numpy(pool.split.owner.astype(np.int32)).flatten().to(self.device)   # [L * E]
        self._device_counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=self.device)
        self.set_handoff(handoff)

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
        # "split" rounds down so that the device path can split one more expert by channels; the paths that
        # cannot split (prefill, the host and stream hand-offs: eager, never captured) round it as min-wait
        # (explicit values). On the device path an expert too small to split (splittable) is left at floor.
        self._unsplit_policy = None if p["fetch_round"] != "split" else dict(
            fetch_fraction=fraction, round_mode="min-wait", select=p["fetch_select"], promote=promote_now,
            seed=int(p["seed"]))
        if cpu_shares and self.pool is not None:
            self.pool.set_shares(cpu_shares)                          # the tuner's per-worker split
            self._owner.copy_(torch.from_numpy(self.pool.split.owner.astype(np.int32)).flatten())   # in place: graphs
        self.policy = p
        self.strategy = p["strategy"]

    @property
    def cpu_active(self) -> bool:
        """Whether the next forward hands misses to the CPU pool."""
        return not self.degraded and self.strategy != "offload"

    def set_handoff(self, handoff: str) -> None:
        """"host" (CpuPool.submit/join), "stream" (StreamDoorbell per pool member; on CUDA it needs 64-bit
        stream memory operations and raises StreamMemOpsUnavailable / CudaDriverError without them), "device"
        (DeviceDoorbell: the ring/join kernels) or "auto" (device on a CUDA GPU, host elsewhere)."""
        if handoff not in HANDOFF_CHOICES:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFF_CHOICES)}, not {handoff!r}")
        handoff = resolve_handoff(handoff, self.on_cuda)
        if handoff == "device" and not self.on_cuda and not interpreted():
            raise ValueError("the device hand-off runs its kernels on a CUDA GPU (on a CPU only in the Triton "
                             "interpreter, TRITON_INTERPRET=1, for tests); use --hybrid-handoff host here")
        if handoff != "stream":
            self._close_doorbells()
        if handoff != "device":
            self._close_device_doorbells()
        for m in self.pool.members:
            if m.serving:                      # fail here, not in the middle of a generation
                if handoff == "stream":
                    self._doorbell(m)
                elif handoff == "device":
                    self._device_doorbell(m)
        if handoff != getattr(self, "handoff", handoff):
            log.info("CPU share hand-off: %s", handoff)
        self.handoff = handoff

    # -- forward ----------------------------------------------------------------------------------
    def side_streams(self) -> list:
        """The copy streams and the stream hand-off's (whose late copy-out writes a tensor of the failed call: the
        compute stream waits for it before that memory can be reused)."""
        if not self.on_cuda:
            return []
        return [self.copy_stream, self.split_stream, *self._handoff_streams.values()]

    def forget_slots_after_error(self, exc: BaseException) -> None:
        """As SlotPoolAudit's (the side streams joined, the cache emptied); then, for an Exception (not an interrupt,
        which should not block on the workers), the CPU shares the failed call handed over and never joined are
        drained (the next submit into their channel slots would be refused, failing every later step) and the
        device doorbells re-synced with their channels' sequence (host-driven calls moved it; a later device ring
        would reuse a number and could take a stale answer). A worker lost meanwhile degrades the backend."""
        super().forget_slots_after_error(exc)
        if not isinstance(exc, Exception) or (self.on_cuda and torch.cuda.is_current_stream_capturing()):
            return
        try:
            if self.pool.drain():
                log.warning("drained the CPU shares a failed expert call left in flight")
            while self._resync:
                self._resync.pop().sync_sequence()
            if not self.pool.all_serving:
                self._degrade()
        except Exception:                           # noqa: BLE001 - the original error is the one to report
            log.exception("draining the CPU shares after a failed expert call failed too")

    def _forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        T, K = topk_ids.shape
        device_path = self.handoff == "device" and self._device_sized(T * K)
        # Re-admission changes what a forward does, so it happens between decode steps (step_begin) where a
        # graph may run; elsewhere (prefill, the host paths, a generation that ends at its first token and
        # never decodes) here, before layer 0.
        if self.degraded and (not device_path or (layer_idx == 0 and not self._in_step)):
            self._readmit()
        ids = topk_ids.to(torch.int32)                                    # [T, K] the router's expert ids
        routes = ids.clone()                                              # [T, K] -> slot ids or -1
        to_cpu = self.cpu_active and self.pool.fits(T, T * K) and T <= self.cpu_max_tokens
        # experts the previous layer's prefill prefetched for this one (copy stream): the GEMMs wait for them. The
        # host path waits after queueing its own copies (as OffloadExperts does), so that its readback's sync
        # does not wait for the prefetch too and leave the copy stream idle meanwhile; the device path (whose
        # copy kernels may run on the compute stream) waits first.
        ready = self._prefetched.pop(layer_idx, None)
        if device_path:
            self._wait_prefetched(ready)
            return self._forward_device(layer_idx, x, ids, routes, topk_weights, to_cpu)
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
                   select=p["fetch_select"], promote=bool(p["promote"]), check_ids=False)
        # A prefill chunk run as offload routes to most experts of every layer: stream the next layer's (a
        # low-priority prefetch of all of them, never evicting this layer's) behind this layer's own copies.
        nxt = (prefill_prefetch_layer(layer_idx, T * K, self.num_experts, self.num_layers, self.gather_max_pairs)
               if not to_cpu and self.prefill_prefetch else None)
        if nxt is not None:
            prefetch_ensure(self.cache, nxt, self._candidates, self._candidates.numel(), check_ids=False)
        t0 = time.perf_counter()
        stream = self.handoff == "stream"
        plan = self.readback.read(self.cache, max_plan=min(self.num_experts, T * K), ids=ids,
                                  routes=routes if to_cpu else None, weights=topk_weights if to_cpu else None,
                                  x=x if to_cpu and not stream else None,     # stream: x goes down by DMA
                                  prefetch_candidates=self._candidates.numel() if nxt is not None else 0)
        st.expert_misses_total += plan.num_misses
        st.expert_hits_total += plan.num_distinct - plan.num_misses
        shares: list[Share] = []
        pending: list[tuple[Share, StreamCall | None]] | None = None
        triples = None
        if to_cpu:
            cpu_rows = np.flatnonzero(plan.routes < 0)                    # [n] flat routes left to the CPU
            if cpu_rows.size:
                # (token, ORIGINAL expert id, weight): copies, so later readbacks cannot overwrite them
                triples = ((cpu_rows // K).astype(np.int32), plan.ids[cpu_rows], plan.weights[cpu_rows])
                if stream:
                    pending = self._enqueue_stream(layer_idx, x, triples)
                else:
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
        if pending is not None:
            return self._join_stream(layer_idx, x, out, triples, pending).to(x.dtype)
        total = self._join(layer_idx, x, out, triples, shares).to(x.dtype)
        while self._resync:                          # after the join: nothing of theirs in flight
            self._resync.pop().sync_sequence()
        return total

    @property
    def preferred_prefill_chunk_tokens(self) -> int | None:
        """The engine's prefill chunk when none is configured (read once, when the engine starts): cpu_max_tokens
        with strategy `cpu`, whose chunks must keep their CPU share (a longer one would run as offload, fetching
        every expert: not what the strategy promises); None otherwise, so that hybrid takes the engine's default
        (4,096), its long chunks running as offload with the prefill prefetch (faster on the H200: 1.07 s against
        7.48 s for a 4K prompt in 512-token chunks at a 25% cache; docs/BENCHMARKS.md, fourteenth session)."""
        return self.cpu_max_tokens if self.strategy == "cpu" else None

    # -- the device hand-off (handoff="device") -------------------------------------------------------
    def _device_sized(self, num_pairs: int) -> bool:
        """Decode-sized: the GEMMs run in a graph-safe mode (no host sync, fixed shapes)."""
        return (num_pairs <= min(self.gather_max_pairs, kernels_handoff.COUNT_MAX_PAIRS)
                and self.mode in ("auto", *GRAPH_SAFE_MODES))

    def graph_safe(self, num_pairs: int) -> bool:
        """The engine may capture decode forwards of this size in a CUDA graph (handoff="device" only)."""
        return self.handoff == "device" and self.on_cuda and self._device_sized(num_pairs)

    def graph_key(self) -> tuple:
        """What a captured decode graph depends on besides shapes: whether misses go to the CPU, and the
        doorbells it rings (a graph holds their addresses: new doorbells, new graphs)."""
        return ("hybrid", self.handoff, self._doorbell_epoch, self.cpu_active, self.splits_experts)

    @property
    def splits_experts(self) -> bool:
        """Whether decode steps on the device hand-off split one expert a layer by channels (fetch_round
        "split", an expert of at least two whole SPLIT_UNITs); elsewhere "split" rounds down only."""
        return (self.policy.get("fetch_round") == "split" and self.strategy == "hybrid"
                and expert_split.splittable(self.layout.intermediate_size))

    def _device_doorbell(self, m) -> DeviceDoorbell:
        db = self._device_doorbells.get(m.index)
        if db is None:
            db = DeviceDoorbell(m.client, self.device, member=m.index, fail=self._device_fail,
                                deadline_s=self.pool.deadline_s)
            self._device_doorbells[m.index] = db
            self._doorbell_epoch += 1
        return db

    def _close_device_doorbells(self) -> None:
        """Close them, keeping what they counted (their state tensors go with them)."""
        if not self._device_doorbells:
            return
        self._fold_device_counters()
        for db in self._device_doorbells.values():
            db.close()
        self._device_doorbells.clear()
        self._doorbell_epoch += 1

    def _forward_device(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor,
                        topk_weights: torch.Tensor, to_cpu: bool) -> torch.Tensor:
        """One layer without a host sync (see the module docstring): ensure, the copy plan as a kernel
        with each member's ring beside it (gemv mode with the overlap; else the rings first), GEMMs over
        slot ids, join each member's partial sums into an fp32 total."""
        T, K = ids.shape
        c, p = self.cache, self.policy
        if to_cpu:      # the device policy: a captured graph follows live changes (split: floor, then split_pick)
            ensure(c, layer_idx, routes, use_device_policy=True, check_ids=False)
        else:
            ensure(c, layer_idx, routes, fetch_fraction=1.0, round_mode=p["fetch_round"],
                   select=p["fetch_select"], promote=bool(p["promote"]), check_ids=False)
        max_copies = min(T * K, c.num_slots)
        split = to_cpu and self.splits_experts
        host_layer = self.host.layers[layer_idx]
        if split:                      # one CPU expert's channels [c, I) to the split slot (kernels/expert_split)
            expert_split.split_pick(routes, ids, c.num_missing_full, c.num_indices, c.policy, self._split_desc,
                                    self._split_counts, intermediate=self.layout.intermediate_size,
                                    split_slot=self.split_slot)

        def fetch_split_part(part: int) -> None:     # (self.split_copy is the plan copy's two-part switch)
            expert_split.split_copy(self.slots, host_layer, self._split_desc, split_slot=self.split_slot,
                                    hidden=self.layout.hidden_size, intermediate=self.layout.intermediate_size,
                                    part=part)

        def ring_and_count() -> None:  # copy_then_ffn's after_fork: on the compute stream, beside the plan copy
            if to_cpu:
                weights = topk_weights.float().contiguous()
                for m in self.pool.members:
                    self._device_doorbell(m).ring(layer_idx, x, ids, routes, weights, owner=self._owner,
                                                  owner_offset=layer_idx * self.num_experts,
                                                  split=self._split_desc if split else None,
                                                  split_slot=self.split_slot)
            kernels_handoff.count_call(self._device_counts, ids, c.num_indices, c.num_missing_full,
                                       offload=not to_cpu)
        mode = self._mode(routes.numel())
        if mode == "gemv":             # routes at -1 (the CPU's) add 0; the copy beside the hits' GEMMs
            out = copy_then_ffn(self.slots, host_layer, c, max_copies, x, routes, topk_weights,
                                self.w13, self.w2, mode=mode, kernel_impl=self.kernel_impl,
                                side_stream=self.copy_stream if self.overlap_copy else None,
                                split_copy=self.split_copy, after_fork=ring_and_count,
                                extra_copy=fetch_split_part if split else None,
                                extra_slot=self.split_slot if split else -1,
                                extra_stream=self.split_stream if self.overlap_copy else None)
        else:
            ring_and_count()
            copy_plan(self.slots, host_layer, c.evict_slots, c.src_indices, c.num_indices, max_copies=max_copies)
            if split:
                fetch_split_part(0)
                fetch_split_part(1)
            out = self._gemm_gpu_routes(x, routes, topk_weights, skip=False)
        if not to_cpu:
            return out
        # Sums in fp32 inside each join; the last one writes the model dtype (one rounding, as the host join).
        members = self.pool.members
        total = torch.empty(x.shape, dtype=torch.float32, device=self.device) if len(members) > 1 else None
        src = out
        for i, m in enumerate(members):
            dst = torch.empty_like(x) if i == len(members) - 1 else total
            self._device_doorbell(m).join(layer_idx, src, dst)
            src = dst
        if not (self.on_cuda and torch.cuda.is_current_stream_capturing()) and not self._device_step_ok():
            # Eager (a graph's warm-up, or no graphs): the failed share is known now; redo the layer as
            # offload (its hits and fetched experts are resident by now, the rest is fetched).
            return self._forward_device(layer_idx, x, ids, ids.clone(), topk_weights, to_cpu=False)
        return src

    def step_begin(self) -> None:
        """Before a decode step (the engine calls it): re-admit restarted workers, wake the watchdog."""
        if self.degraded and not self._hold_degraded:
            self._readmit()
        self._hold_degraded = False
        self._in_step = True
        for db in self._device_doorbells.values():
            db.deadline_s = self.pool.deadline_s            # operators and tests change it live
            db.arm()

    def step_end(self) -> bool:
        """After a step's kernels (syncs the stream first): False when a device hand-off failed, which
        marks the worker failed (a late one is killed), clears the flags and switches to offload: the
        caller re-runs the step, which then fetches every miss."""
        self._in_step = False
        for db in self._device_doorbells.values():
            db.disarm()
        return self._device_step_ok()

    def _device_step_ok(self) -> bool:
        """step_end without disarming (also after each eager layer): sync, then the failure words."""
        if not self._device_doorbells:
            return True
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        failed = [(m, db) for m in self.pool.members
                  if (db := self._device_doorbells.get(m.index)) is not None and db.failure()]
        if not failed:
            return True
        st = self.stats
        for m, db in failed:
            reason = db.failure_reason()
            st.cpu_workers[m.name].failures_total += 1
            if db.failure() == kernels_handoff.FAIL_STATUS:
                m.failures_total += 1                           # a bad request is not a dead worker: kept
                m.last_error = f"device hand-off: {reason}"
                log.error("CPU worker %s answered with an error status; re-running the step by fetching", m.name)
            elif "dead" in reason or db.failure() == kernels_handoff.FAIL_REPLACED:
                self.pool.mark_failed(m, WorkerDead(f"CPU worker {m.name}: device hand-off {reason}"))
            else:
                self.pool.mark_failed(m, WorkerTimeout(f"CPU worker {m.name}: device hand-off {reason}"))
        for db in self._device_doorbells.values():
            db.reset()
        st.fallbacks_total += 1
        self._degrade()
        self._hold_degraded = True          # the re-run fetches every miss, whatever re-admission would say
        return False

    def _gemm(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, skip: bool) -> torch.Tensor:
        """sum_k w_k * FFN_{slot_k}(x) over slot ids [T, K] -> [T, H] (x.dtype); zeros when `skip`."""
        if skip:
            return torch.zeros_like(x)
        return expert_ffn(self._mode(slot_ids.numel()), x, slot_ids, weights, self.w13, self.w2,
                          kernel_impl=self.kernel_impl)

    def _gemm_gpu_routes(self, x: torch.Tensor, routes: torch.Tensor, weights: torch.Tensor,
                         skip: bool) -> torch.Tensor:
        """_gemm over routes some of which are -1 (the CPU's): gemv skips them (adds exactly 0); the other
        modes read slot 0 with weight 0 (the module docstring, step 5, says why that adds 0 too)."""
        if self._mode(routes.numel()) == "gemv":
            return self._gemm(x, routes, weights, skip=skip)
        valid = routes >= 0
        return self._gemm(x, torch.where(valid, routes, 0), torch.where(valid, weights, 0.0), skip=skip)

    def _mode(self, num_pairs: int) -> str:
        return pick_mode(self.mode, self.on_cuda, num_pairs, self.gather_max_pairs)

    def _wait_prefetched(self, ready: torch.cuda.Event | None) -> None:
        """The compute stream waits for the experts a prefill prefetched for this layer (timed as a copy wait)."""
        if ready is None:
            return
        compute = torch.cuda.current_stream(self.device)
        wait_from = self.timer.mark(compute)
        compute.wait_event(ready)
        self.timer.add("gpu_wait_for_copy_s_total", wait_from, self.timer.mark(compute))

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
                self._count_cpu_share(share)
        total = out.float() + partial.to(self.device, non_blocking=True)     # [T, H] fp32
        return self._recover(layer_idx, x, total, triples, failed)

    def _count_cpu_share(self, share) -> None:
        """Fold an answered CPU share into the per-worker and total counters."""
        self._count_cpu(share.member.name, share.num_experts, share.rows.size, share.compute_s)

    def _count_cpu(self, worker: str, experts: int, triples: int, seconds: float) -> None:
        st = self.stats
        wc = st.cpu_workers[worker]
        wc.experts_total += experts
        wc.triples_total += triples
        wc.time_s_total += seconds
        st.cpu_experts_total += experts
        st.cpu_triples_total += triples
        st.cpu_expert_time_s_total += seconds

    def _recover(self, layer_idx: int, x: torch.Tensor, total: torch.Tensor,
                 triples: tuple[np.ndarray, np.ndarray, np.ndarray], failed: list) -> torch.Tensor:
        """Fetch the shares no worker answered into total [T, H] fp32; offload until re-admitted."""
        st = self.stats
        for share in failed:
            st.cpu_workers[share.member.name].failures_total += 1
            total = self._fetch_instead(layer_idx, x, total, *(t[share.rows] for t in triples))
        if failed:
            self._degrade()
        return total

    # -- the GPU-stream hand-off (handoff="stream") --------------------------------------------------
    def _doorbell(self, m) -> "StreamDoorbell":
        """Member m's doorbell: created on first use, reconnected after a fault once m was re-admitted."""
        db = self._doorbells.get(m.index)
        if db is None:
            from .stream_doorbell import StreamDoorbell

            db = StreamDoorbell(m.client, self.device, deadline_s=self.pool.deadline_s)
            self._doorbells[m.index] = db
            if self.on_cuda:
                self._handoff_streams[m.index] = torch.cuda.Stream(device=self.device)
        elif db.failed is not None:
            try:
                db.reconnect(timeout_s=RECONNECT_TIMEOUT_S)
            except WorkerTimeout as exc:        # no worker yet: not a late one (WorkerTimeout would kill it)
                raise WorkerDead(str(exc)) from exc
        return db

    def _close_doorbells(self) -> None:
        for db in self._doorbells.values():
            db.close(timeout_s=max(self.pool.deadline_s, 1.0))
        self._doorbells.clear()
        self._handoff_streams.clear()
        self._staging.clear()

    def _enqueue_stream(self, layer_idx: int, x: torch.Tensor, triples: tuple[np.ndarray, np.ndarray, np.ndarray]
                        ) -> list[tuple[Share, "StreamCall | None"]]:
        """Each owner's share as one StreamDoorbell call (no host wait); a member whose doorbell refuses
        (worker known dead or late) gets a share with its error set, fetched at the join."""
        token, expert, weight = triples
        pending = []
        for m, rows in zip(self.pool.members, self.pool.split.split_triples(layer_idx, expert)):
            if rows.size == 0:
                continue
            experts = expert[rows]
            share = Share(m, rows, int(np.unique(experts).size))
            call = None
            try:
                db = self._doorbell(m)
                db.deadline_s = self.pool.deadline_s           # tests and operators change it live
                call = self._enqueue_one(db, m.index, layer_idx, x, token[rows], experts, weight[rows])
            except (WorkerDead, WorkerTimeout) as exc:
                share.error = exc
                self.pool.mark_failed(m, exc)
            pending.append((share, call))
        return pending

    def _enqueue_one(self, db: "StreamDoorbell", index: int, layer_idx: int, x: torch.Tensor, token: np.ndarray,
                     expert: np.ndarray, weight: np.ndarray) -> "StreamCall":
        n = token.size
        if not self.on_cuda:
            return db.enqueue(layer_idx, x, (torch.from_numpy(token), torch.from_numpy(expert),
                                             torch.from_numpy(weight)))
        # Triples: numpy -> pinned staging (reused: the previous call of this member is done, the host waited
        # for it) -> device on the member's side stream -> the channel (enqueue's D2H, stream-ordered).
        ints, w = self._staging.get(index, (None, None))
        if ints is None or ints.numel() < 2 * n:
            ints = torch.empty(max(2 * n, 64), dtype=torch.int32, pin_memory=True)
            w = torch.empty(max(n, 32), dtype=torch.float32, pin_memory=True)
            self._staging[index] = (ints, w)
        ints[:n].numpy()[:] = token
        ints[n:2 * n].numpy()[:] = expert
        w[:n].numpy()[:] = weight
        T, H = x.shape
        out = torch.empty(T, H, dtype=torch.float32, device=self.device)     # allocated on the compute stream
        side = self._handoff_streams[index]
        side.wait_stream(torch.cuda.current_stream(self.device))             # x is ready
        with torch.cuda.stream(side):
            dev_ints = ints[:2 * n].to(self.device, non_blocking=True)
            dev_w = w[:n].to(self.device, non_blocking=True)
            return db.enqueue(layer_idx, x, (dev_ints[:n], dev_ints[n:], dev_w), out=out, stream=side)

    def _join_stream(self, layer_idx: int, x: torch.Tensor, out: torch.Tensor,
                     triples: tuple[np.ndarray, np.ndarray, np.ndarray],
                     pending: list[tuple[Share, "StreamCall | None"]]) -> torch.Tensor:
        """out [T, H] (GPU part) + the calls' partial sums -> [T, H] fp32. On CUDA the add is queued behind
        the side streams (the GPU waits for the CPU, the host does not), then the host waits for the calls
        on host memory and checks them; a failed share is fetched instead (the sum is rebuilt from the
        valid calls only, so a stale partial never reaches the output)."""
        calls = [(share, call) for share, call in pending if call is not None]
        total = None
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.device)
            wait_from = self.timer.mark(compute)
            for share, _ in calls:
                compute.wait_stream(self._handoff_streams[share.member.index])
            self.timer.add("gpu_wait_for_cpu_s_total", wait_from, self.timer.mark(compute))
            total = self._add_partials(out, calls)                       # stream-ordered
            failed = self._settle(layer_idx, pending)
        else:
            wait_from = self.timer.mark()
            failed = self._settle(layer_idx, pending)
            self.timer.add("gpu_wait_for_cpu_s_total", wait_from, self.timer.mark())
        if failed or total is None:
            total = self._add_partials(out, [(s, c) for s, c in calls if s.error is None])
        return self._recover(layer_idx, x, total, triples, failed)

    @staticmethod
    def _add_partials(out: torch.Tensor, calls: list) -> torch.Tensor:
        total = out.float()
        for _, call in calls:                                            # in worker order, as the host join
            total = total + call.out
        return total

    def _settle(self, layer_idx: int, pending: list[tuple[Share, "StreamCall | None"]]) -> list[Share]:
        """Wait for every call (host memory; the watchdog releases a call whose worker died or is late),
        count the answered ones, mark the others failed. Returns the failed shares."""
        failed = []
        for share, call in pending:
            m = share.member
            if call is not None:
                db = call.doorbell
                if not call.wait(timeout_s=db.deadline_s + STREAM_WAIT_SLACK_S):
                    log.error("stream call %d of %s not released by the watchdog; aborting it", call.seq, m.name)
                    db.abort("timeout")
                    call.wait(timeout_s=STREAM_WAIT_SLACK_S)
                status = call.status() if call.done() else "not done"
                if status in ("ok", "unchecked"):
                    share.compute_s = m.client.last_compute_ns(layer_idx) / 1e9
                    self._count_cpu_share(share)
                    continue
                if status in ("aborted", "not done"):
                    exc_type = WorkerTimeout if db.failed == "timeout" or status == "not done" else WorkerDead
                    share.error = exc_type(f"CPU worker {m.name}: stream call {call.seq} (layer {layer_idx}) "
                                           f"{status} ({db.failed or 'timeout'})")
                    self.pool.mark_failed(m, share.error)
                else:                       # the worker answered with an error status: fetch, keep the worker
                    share.error = WorkerError(f"CPU worker answered layer {layer_idx} with {status}; see its log")
                    m.failures_total += 1
                    m.last_error = str(share.error)
                    log.error("CPU worker %s: %s; fetching its share of layer %d instead", m.name, share.error,
                              layer_idx)
            failed.append(share)
        return failed

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
            db = self._device_doorbells.get(m.index)
            if db is not None:
                db.reset()                    # the client reconnected in poll(); clear the abort word
        if self.pool.all_serving:
            self.degraded = False
            self.stats.readmissions_total += 1
            log.warning("CPU pool complete again: back to %s", self.strategy)

    # -- telemetry and life cycle -----------------------------------------------------------------
    def counters(self) -> dict:
        """Cumulative counters (HybridStats fields) with the event timings resolved; plus the mode."""
        self.timer.resolve()
        self._fold_device_counters()
        out = self.stats.as_dict()
        out["mode"] = "offload (CPU pool down)" if self.degraded else self.strategy
        out["handoff"] = self.handoff
        return out

    def _fold_device_counters(self) -> None:
        """Move what the device path counted since the last fold into `stats` (a device sync; between steps,
        so zeroing the device counts loses nothing)."""
        counts = self._device_counts.tolist()
        splits, split_channels = self._split_counts.tolist()
        if splits:
            self._split_counts.zero_()
            st = self.stats
            st.split_experts_total += splits
            st.split_gpu_channels_total += split_channels
            st.copy_bytes_total += split_channels * 3 * self.layout.hidden_size * self.slots.element_size()
        if not any(counts):
            return
        self._device_counts.zero_()
        st = self.stats
        for name, value in zip(DEVICE_COUNTERS, counts):
            setattr(st, name, getattr(st, name) + value)
        st.copy_bytes_total += counts[0] * self.layout.expert_nbytes
        for m in self.pool.members:
            db = self._device_doorbells.get(m.index)
            if db is not None:
                d = db.take_counters()
                self._count_cpu(m.name, d["experts"], d["triples"], d["compute_ns"] / 1e9)
                wait_s = d["wait_ns"] / 1e9        # the joins run one after another: their waits add up
                st.cpu_workers[m.name].gpu_wait_s_total += wait_s
                st.gpu_wait_for_cpu_s_total += wait_s
                st.gpu_wait_for_cpu_unpaired_s_total += wait_s

    @property
    def expert_nbytes(self) -> int:
        return self.layout.expert_nbytes

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def close(self) -> None:
        self._close_doorbells()                # before the pool: a doorbell needs its client
        self._close_device_doorbells()
        if self.owns_pool:
            self.pool.close()
        if self.owns_host:
            self.host.close()
        self.owns_pool = self.owns_host = False
