"""`HybridExperts`: the `hybrid` and `cpu` expert backends. Misses are split between PCIe fetches and
the CPU expert pool; hits run on the GPU slot pool.

forward(layer, x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H] takes one of two paths:
- the device hand-off (device_path.py) for decode-sized forwards on a CUDA GPU: no host sync, captured in
  the engine's decode CUDA graph; the CPU share goes to the workers by ring/join kernels;
- the host hand-off (host_path.py) for everything else (a CPU device, prefill chunks, eager larger calls):
  one readback a layer, the CPU share submitted to the pool and joined on the host.
On both, ensure (kernels/slot_cache) with the policy (fraction f, rounding, promotion; `set_policy` changes
it live) gives hits and fetched misses slot ids and leaves the rest at -1, the CPU's. The expert GEMMs run
over the slot ids with the mode rule of `ResidentExperts` (`pick_mode`). In the gemv mode (moe_gemv) a route
at -1 is skipped and adds exactly 0. The grouped mode reads slot 0 with weight 0 instead: the pool
starts zeroed and only ever receives real experts, so every slot holds finite values and such a route adds 0
too (never 0 * NaN); the sums are the same.

A CPU share that is not answered (worker dead, deadline missed, error) is fetched instead; the backend then
runs as offload (nothing to the CPU) until every worker is back: the supervisor restarts it (the store in
shared memory survives), `CpuPool.poll` re-admits it once its channel answers. Forwards with more than
`cpu_max_tokens` tokens, or more triples than a channel holds, run as offload too; such a call whose routes
cover at least `num_experts` pairs and that is not decode-sized (a prefill chunk; also a large batch while
the pool is down) streams the next layer's experts behind its own copies, as `OffloadExperts` does
(`prefill_prefetch`). With strategy `cpu` at start the engine keeps prefill chunks of `cpu_max_tokens`
(`preferred_prefill_chunk_tokens`), so that nothing is fetched.
`cpu` = this backend with f = 0 and promotion off (docs/HYBRID.md says why the pool stays).
Legend: T tokens, K top-k, H hidden, E experts per layer, S slots per pool, n triples.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ftexpert.gpu_worker.backends.expert_math import expert_rows
from ftexpert.gpu_worker.backends.resident import MODES, pick_mode
from ftexpert.gpu_worker.backends.offload import HostExperts
from ftexpert.gpu_worker.backends.offload.decode_copy import DecodeCopy
from ftexpert.gpu_worker.backends.offload.slot_pool import SlotPoolAudit, eviction_settings
from ftexpert.kernels import expert_split
from ftexpert.kernels.impl import interpreted
from ftexpert.kernels.slot_cache import SlotCache, set_policy
from ftexpert.kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES
from ftexpert.proto.knobs import KNOBS_BY_FIELD

from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool
from ftexpert.gpu_worker.backends.hybrid.device_doorbell import DeviceDoorbell
from ftexpert.gpu_worker.backends.hybrid.device_path import DEVICE_COUNTERS, DeviceHandoff
from ftexpert.gpu_worker.backends.hybrid.host_path import HostHandoff
from ftexpert.gpu_worker.backends.hybrid.readback import Readback
from ftexpert.gpu_worker.backends.hybrid.stats import HybridStats, StreamTimer, WorkerCounters

log = logging.getLogger("ft.hybrid")

STRATEGIES = ("hybrid", "cpu", "offload")     # what set_policy(strategy=...) may switch between


class HybridExperts(DeviceHandoff, HostHandoff, SlotPoolAudit):
    """Expert backend over a GPU slot pool and a CPU expert pool; see the module docstring.

    device_handoff_on_cpu: on a CPU model, run the device hand-off's kernels in the Triton interpreter
    (TRITON_INTERPRET=1; tests of that path without a GPU). On a CUDA GPU the device hand-off is always on."""

    def __init__(self, host: HostExperts, num_slots: int, device: torch.device | str, pool: CpuPool, *,
                 strategy: str = "hybrid", fetch_fraction: float = 0.5,
                 fetch_round: str = KNOBS_BY_FIELD["fetch_round"].default, promote: bool = True, seed: int = 0,
                 per_layer: bool = False, mode: str = "auto", gather_max_pairs: int = 32, cpu_max_tokens: int = 512,
                 owns_host: bool = True, owns_pool: bool = True, split_copy: bool = True,
                 freq_weight: int | None = None,
                 freq_half_life: int | None = None, device_handoff_on_cpu: bool = False):
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        self.host, self.pool, self.layout = host, pool, host.layout
        self.owns_host, self.owns_pool = owns_host, owns_pool
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        if device_handoff_on_cpu and not self.on_cuda and not interpreted():
            raise ValueError("the device hand-off runs its kernels on a CUDA GPU; on a CPU only in the Triton "
                             "interpreter (TRITON_INTERPRET=1, for tests)")
        self.device_handoff = self.on_cuda or device_handoff_on_cpu   # decode-sized calls take the device path
        self.mode, self.gather_max_pairs = mode, gather_max_pairs
        self.kernel_impl = "auto"     # moe_gemv: Triton on CUDA, reference on CPU ("triton": tests)
        self.cpu_max_tokens = min(cpu_max_tokens, pool.t_max)
        self.cache = SlotCache.create(self.num_layers, self.num_experts, num_slots, device=self.device,
                                      per_layer=per_layer,     # None: the FREETOKEN_EVICTION_FREQ_* knobs
                                      **eviction_settings(freq_weight, freq_half_life))
        # slots: [S_total + 1, N]; zeroed once so that every slot always holds finite values (the module
        # docstring). The last row, outside the cache, is the split slot: the GPU's channels of the expert split
        # under fetch_round "split" (kernels/expert_split; device hand-off only).
        self.split_slot = self.cache.total_slots
        self.slots = self.layout.zeros_layer(self.cache.total_slots + 1, device=self.device)
        self._split_desc = torch.tensor([-1, 0], dtype=torch.int32, device=self.device)   # expert, limit c
        self._split_counts = torch.zeros(expert_split.COUNTS_LEN, dtype=torch.int64, device=self.device)
        self.rows = expert_rows(self.slots, self.layout)      # the expert math over the slots (any format)
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.split_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None   # the split copy
        # device hand-off: the plan copy by the copy kernel on copy_stream beside the hits' GEMMs, in two parts
        # (w13, then w2) unless split_copy is off; the split expert's copy on split_stream beside it
        self.decode_copy = DecodeCopy(self.slots, self.host.layers, self.cache, self.rows,
                                      stream=self.copy_stream, split=split_copy, extra_stream=self.split_stream)
        self._queued = torch.cuda.Event() if self.on_cuda else None
        # prefill chunks run as offload (more than cpu_max_tokens tokens) stream the next layer's experts
        # behind their own; layer -> the event after its prefetched experts' copies
        self.prefill_prefetch = True
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
                        promote=promote, seed=seed)
        self.degraded = False             # a worker failed: offload until every one is back
        self.fetch_fraction_source = "given"   # or "flag", "default", "profile:PATH" (attached_backends.py)
        # The device hand-off: one DeviceDoorbell per member, one failure flag for all, the owner map on the
        # device, and the device path's own counters (no host sync): DEVICE_COUNTERS.
        self._device_doorbells: dict[int, DeviceDoorbell] = {}
        self._resync: set[DeviceDoorbell] = set()         # doorbells whose channel took host-driven calls
        self._doorbell_epoch = 0                          # graph_key: graphs hold the doorbells' addresses
        self._hold_degraded = False                       # a failed device step's re-run must not re-admit
        self._in_step = False                             # between step_begin and step_end (a decode step)
        self._device_fail = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._owner = torch.from_numpy(pool.split.owner.astype(np.int32)).flatten().to(self.device)   # [L * E]
        self._device_counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=self.device)
        if self.device_handoff:
            for m in pool.members:
                if m.serving:                  # fail here, not in the middle of a generation
                    self._device_doorbell(m)
            log.info("CPU share hand-off: device kernels for decode-sized calls, the host for the rest")

    def _hidden_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.pool.hidden_dtype == "bfloat16" else torch.float32

    # -- policy -----------------------------------------------------------------------------------
    def set_policy(self, *, strategy: str | None = None, fetch_fraction: float | None = None,
                   fetch_round: str | None = None, promote: bool | None = None, seed: int | None = None,
                   cpu_shares: dict[str, float] | None = None, **other) -> None:
        """Change the split live (the coordinator's engine.set_policy lands here): writes the device policy
        tensor that ensure reads. strategy: hybrid (f as given), cpu (f = 0, no promotion), offload (f = 1)."""
        self._prefetch_policy(other)
        unknown = sorted(other)
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(unknown)}")
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"this backend switches between {', '.join(STRATEGIES)}, not {strategy!r} "
                             f"(resident needs a restart with --moe-strategy resident)")
        p = dict(self.policy)
        for key, value in (("strategy", strategy), ("fetch_fraction", fetch_fraction), ("fetch_round", fetch_round),
                           ("promote", promote), ("seed", seed)):
            if value is not None:
                p[key] = value
        fraction, promote_now = float(p["fetch_fraction"]), bool(p["promote"])
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fetch_fraction must be within [0, 1], got {fraction!r}")
        if p["strategy"] == "cpu":
            fraction, promote_now = 0.0, False
        elif p["strategy"] == "offload":
            fraction = 1.0
        set_policy(self.cache, fetch_fraction=fraction, round_mode=p["fetch_round"],
                   promote=promote_now, seed=int(p["seed"]))          # validates before writing
        # "split" rounds down so that the device path can split one more expert by channels; the host path
        # (prefill, eager: never captured), which cannot split, rounds it as min-wait (explicit values). On the
        # device path an expert too small to split (splittable) is left at floor.
        self._unsplit_policy = None if p["fetch_round"] != "split" else dict(
            fetch_fraction=fraction, round_mode="min-wait", promote=promote_now,
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

    @property
    def splits_experts(self) -> bool:
        """Whether decode steps on the device hand-off split one expert a layer by channels (fetch_round
        "split", a bf16 expert of at least two whole SPLIT_UNITs: the split copy moves rows and columns of the
        weights, which a quantized expert's bytes do not lay out; nor a biased one's, whose down bias belongs to one
        side); elsewhere "split" rounds down only."""
        return (self.policy.get("fetch_round") == "split" and self.strategy == "hybrid"
                and not self.layout.quantized and not self.layout.act.bias
                and expert_split.splittable(self.layout.intermediate_size))

    def preferred_prefill_chunk_tokens(self) -> int | None:
        """The engine's prefill chunk when none is configured (read once, when the engine starts): cpu_max_tokens
        with strategy `cpu`, whose chunks must keep their CPU share (a longer one would run as offload, fetching
        every expert: not what the strategy promises); None otherwise, so that hybrid takes the engine's default
        (4,096), its long chunks running as offload with the prefill prefetch (faster on the H200: 1.07 s against
        7.48 s for a 4K prompt in 512-token chunks at a 25% cache; docs/BENCHMARKS.md)."""
        return self.cpu_max_tokens if self.strategy == "cpu" else None

    # -- forward ----------------------------------------------------------------------------------
    def _forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        T, K = topk_ids.shape
        device_path = self.device_handoff and self._device_sized(T * K)
        # Re-admission changes what a forward does, so it happens between decode steps (step_begin) where a
        # graph may run; elsewhere (prefill, the host path, a generation that ends at its first token and
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
        if self.lookahead is not None:     # score this layer's prediction, predict the next layer's
            self.lookahead.begin(layer_idx, x, topk_ids, self._device_sized(T * K))
        if device_path:
            self._wait_prefetched(ready)
            out = self._forward_device(layer_idx, x, ids, routes, topk_weights, to_cpu)
            if self.lookahead is not None:
                self.lookahead.copy(layer_idx)         # the next layer's prefetch plan, behind this demand copy
            return out
        return self._forward_host(layer_idx, x, ids, routes, topk_weights, to_cpu, ready)

    def _after_ensure(self, layer_idx: int) -> bool:
        """Right after this layer's ensure: wait for its lookahead prefetch copy, install the next layer's. True
        when a prefetch plan for layer + 1 was written (mode on)."""
        la = self.lookahead
        if la is None:
            return False
        la.wait(layer_idx)
        return la.install(layer_idx)

    def _gemm(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, skip: bool) -> torch.Tensor:
        """sum_k w_k * FFN_{slot_k}(x) over slot ids [T, K] -> [T, H] (x.dtype); zeros when `skip`."""
        if skip:
            return torch.zeros_like(x)
        return self.rows.ffn(self._mode(slot_ids.numel()), x, slot_ids, weights, kernel_impl=self.kernel_impl)

    def _gemm_gpu_routes(self, x: torch.Tensor, routes: torch.Tensor, weights: torch.Tensor,
                         skip: bool) -> torch.Tensor:
        """_gemm over routes some of which are -1 (the CPU's): gemv skips them (adds exactly 0); the grouped
        mode reads slot 0 with weight 0 (the module docstring says why that adds 0 too)."""
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

    def side_streams(self) -> list:
        """The copy streams (the plan copy's and the split copy's)."""
        streams = [self.copy_stream, self.split_stream] if self.on_cuda else []
        if self.on_cuda and self.lookahead is not None:
            streams.append(self.lookahead.predict_stream)
        return streams

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

    # -- the engine's step and graph hooks ------------------------------------------------------------
    def graph_safe(self, num_pairs: int) -> bool:
        """The engine may capture decode forwards of this size in a CUDA graph (the device hand-off's)."""
        return self.on_cuda and self._device_sized(num_pairs) and self.verifier is None   # the verifier syncs

    def graph_key(self) -> tuple:
        """What a captured decode graph depends on besides shapes: whether misses go to the CPU, whether an
        expert is split, and the doorbells it rings (a graph holds their addresses: new doorbells, new graphs)."""
        return ("hybrid", self._doorbell_epoch, self.cpu_active, self.splits_experts,
                self.lookahead.graph_key() if self.lookahead else ())

    def decode_steps_may_overlap(self) -> bool:
        """No: step_end must see each step's hand-off end (a failed step is re-run) before the next is queued."""
        return False

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

    # -- telemetry and life cycle -----------------------------------------------------------------
    def counters(self) -> dict:
        """Cumulative counters (HybridStats fields) with the event timings resolved; plus the mode."""
        self.timer.resolve()
        self._fold_device_counters()
        out = {**self.stats.as_dict(), **self.prefetch_counters()}
        out["mode"] = "offload (CPU pool down)" if self.degraded else self.strategy
        return out

    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def close(self) -> None:
        self._close_device_doorbells()         # before the pool: a doorbell needs its client
        if self.owns_pool:
            self.pool.close()
        if self.owns_host:
            self.host.close()
        self.owns_pool = self.owns_host = False
