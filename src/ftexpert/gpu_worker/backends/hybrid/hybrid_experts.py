"""`HybridExperts`: the `hybrid` and `cpu` expert backends. Misses are split between PCIe fetches and
the CPU expert pool; hits run on the GPU slot pool.

forward(layer, x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H] takes one of two paths:
- the device hand-off (device_path.py) for decode-sized forwards on a CUDA GPU: no host sync, captured in
  the engine's decode CUDA graph; the CPU share goes to the workers by ring/join kernels;
- the host hand-off (host_path.py) for everything else (a CPU device, prefill chunks, eager larger calls):
  one readback a layer, the CPU share submitted to the pool and joined on the host.
On both, ensure (kernels/slot_cache) with the policy (fraction f, rounding, promotion; `set_policy` changes
it live) gives hits and fetched misses slot ids and leaves the rest at -1, the CPU's. The expert GEMMs run
over the slot ids with the mode rule of `ResidentExperts` (slot_gemm.py, which says why a route at -1 adds
exactly 0 in either mode).

A CPU share that is not answered (worker dead, deadline missed, error) is fetched instead; the backend then
runs as offload (nothing to the CPU) until every worker is back: the supervisor restarts it (the store in
shared memory survives), `CpuPool.poll` re-admits it once its channel answers. Forwards with more than
`cpu_max_tokens` tokens, or more triples than a channel holds, run as offload too; such a call whose routes
cover at least `num_experts` pairs and that is not decode-sized (a prefill chunk; also a large batch while
the pool is down) streams the next layer's experts behind its own copies, as `OffloadExperts` does
(`prefill_prefetch`). With strategy `cpu` at start the engine keeps prefill chunks of `cpu_max_tokens`
(`preferred_prefill_chunk_tokens`), so that nothing is fetched.
`cpu` = this backend with f = 0 and promotion off (docs/HYBRID.md says why the pool stays).

The backend owns its parts, each built here with what it needs, and delegates to them:
  slot_pool     SlotPool (offload/slot_pool.py): the slot cache `cache`, the pool `slots`, the lookahead prefetch,
                the prefill prefetch's pending events, the audit, the reset after an error
  pool          CpuPool (cpu_pool.py): the CPU expert workers
  doorbells     PoolDoorbells (doorbells.py): the members' device doorbells
  split_policy  SplitPolicy (split_policy.py): the policy and the device policy tensor
  gemm          SlotGemm (slot_gemm.py): the expert GEMMs over slot ids
  device_path   DevicePath (device_path.py), host_path  HostPath (host_path.py): the two hand-offs
  stats, timer  HybridStats, StreamTimer (stats.py)
What stays here: which path a forward takes, the fallback state (degraded, re-admission), the engine's step and
graph hooks, set_policy, counters and close.
Legend: T tokens, K top-k, H hidden, E experts per layer, S slots per pool, n triples.
"""
from __future__ import annotations

import logging

import torch

from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.backends.expert_math import expert_rows
from ftexpert.gpu_worker.backends.expert_compute import MODES
from ftexpert.gpu_worker.backends.offload import HostExperts
from ftexpert.gpu_worker.backends.offload.prefetch import PrefetchSettings, Predictor
from ftexpert.gpu_worker.backends.offload.slot_pool import SlotPool, eviction_settings
from ftexpert.kernels.impl import interpreted
from ftexpert.kernels.slot_cache import SlotCache
from ftexpert.proto.knobs import KNOBS_BY_FIELD

from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool
from ftexpert.gpu_worker.backends.hybrid.device_path import DevicePath
from ftexpert.gpu_worker.backends.hybrid.doorbells import PoolDoorbells
from ftexpert.gpu_worker.backends.hybrid.host_path import HostPath
from ftexpert.gpu_worker.backends.hybrid.slot_gemm import SlotGemm
from ftexpert.gpu_worker.backends.hybrid.split_policy import SplitPolicy
from ftexpert.gpu_worker.backends.hybrid.stats import HybridStats, StreamTimer, WorkerCounters

log = logging.getLogger("ft.hybrid")


class HybridExperts(ExpertBackend):
    """Expert backend over a GPU slot pool and a CPU expert pool; see the module docstring.

    device_handoff_on_cpu: on a CPU model, run the device hand-off's kernels in the Triton interpreter
    (TRITON_INTERPRET=1; tests of that path without a GPU). On a CUDA GPU the device hand-off is always on."""

    has_slot_cache = True

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
        self.cpu_max_tokens = min(cpu_max_tokens, pool.t_max)
        self.cache = SlotCache.create(self.num_layers, self.num_experts, num_slots, device=self.device,
                                      per_layer=per_layer,     # None: the FREETOKEN_EVICTION_FREQ_* knobs
                                      **eviction_settings(freq_weight, freq_half_life))
        # slots: [S_total + 1, N]; zeroed once so that every slot always holds finite values (slot_gemm.py). The
        # last row, outside the cache, is the device path's split slot (fetch_round "split", kernels/expert_split).
        self.slots = self.layout.zeros_layer(self.cache.total_slots + 1, device=self.device)
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.split_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None   # the split copy
        self.slot_pool = SlotPool(self.cache, self.slots, host.layers, self.device, self.copy_stream,
                                  extra_streams=(self.split_stream,) if self.on_cuda else ())
        self.gemm = SlotGemm(expert_rows(self.slots, self.layout), on_cuda=self.on_cuda, mode=mode,
                             gather_max_pairs=gather_max_pairs)
        self.stats = HybridStats(cpu_workers={m.name: WorkerCounters() for m in pool.members})
        self.timer = StreamTimer(self.on_cuda, self.stats)
        self.split_policy = SplitPolicy(self.cache)
        self.doorbells = PoolDoorbells(pool, self.device)
        parts = (self.slot_pool, self.layout, pool, self.doorbells, self.gemm, self.split_policy, self.stats,
                 self.timer)
        self.device_path = DevicePath(*parts, copy_stream=self.copy_stream, split_stream=self.split_stream,
                                      split_copy=split_copy, on_failed_step=self._fail_step)
        self.host_path = HostPath(*parts, copy_stream=self.copy_stream, degrade=self._degrade)
        self.degraded = False             # a worker failed: offload until every one is back
        self._hold_degraded = False       # a failed device step's re-run must not re-admit
        self._in_step = False             # between step_begin and step_end (a decode step)
        self.set_policy(strategy=strategy, fetch_fraction=fetch_fraction, fetch_round=fetch_round,
                        promote=promote, seed=seed)
        if self.device_handoff:
            for m in pool.members:
                if m.serving:                  # fail here, not in the middle of a generation
                    self.doorbells.for_member(m)
            log.info("CPU share hand-off: device kernels for decode-sized calls, the host for the rest")

    # -- settings kept on the backend: its parts hold them ------------------------------------------
    @property
    def policy(self) -> dict:
        """The current policy: strategy, fetch_fraction, fetch_round, promote, seed (SplitPolicy)."""
        return self.split_policy.policy

    @property
    def fetch_fraction_source(self) -> str:
        """Where the starting fetch fraction came from (the backend factory sets it; SplitPolicy)."""
        return self.split_policy.fetch_fraction_source

    @fetch_fraction_source.setter
    def fetch_fraction_source(self, value: str) -> None:
        self.split_policy.fetch_fraction_source = value

    @property
    def mode(self) -> str:
        """The expert compute mode: auto | grouped | gemv (SlotGemm)."""
        return self.gemm.mode

    @mode.setter
    def mode(self, value: str) -> None:
        self.gemm.mode = value

    @property
    def prefill_prefetch(self) -> bool:
        """Whether prefill chunks run as offload stream the next layer's experts behind their own (HostPath)."""
        return self.host_path.prefill_prefetch

    @prefill_prefetch.setter
    def prefill_prefetch(self, value: bool) -> None:
        self.host_path.prefill_prefetch = value

    # -- policy -----------------------------------------------------------------------------------
    def set_policy(self, *, strategy: str | None = None, fetch_fraction: float | None = None,
                   fetch_round: str | None = None, promote: bool | None = None, seed: int | None = None,
                   cpu_shares: dict[str, float] | None = None, **other) -> None:
        """Change the split live (the coordinator's engine.set_policy lands here): writes the device policy
        tensor that ensure reads. strategy: hybrid (f as given), cpu (f = 0, no promotion), offload (f = 1).
        The prefetch's fields go to the slot pool's lookahead; `cpu_shares` re-split the experts among the
        workers (the owner map the device path reads is updated in place)."""
        self.slot_pool.prefetch_policy(other)
        unknown = sorted(other)
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(unknown)}")
        p = self.split_policy.apply(strategy=strategy, fetch_fraction=fetch_fraction, fetch_round=fetch_round,
                                    promote=promote, seed=seed)
        if cpu_shares and self.pool is not None:
            self.pool.set_shares(cpu_shares)                          # the tuner's per-worker split
            self.device_path.update_owner_map()
        self.split_policy.adopt(p)

    @property
    def cpu_active(self) -> bool:
        """Whether the next forward hands misses to the CPU pool."""
        return not self.degraded and self.split_policy.strategy != "offload"

    @property
    def splits_experts(self) -> bool:
        """Whether decode steps on the device hand-off split one expert a layer by channels (DevicePath)."""
        return self.device_path.splits_experts

    def preferred_prefill_chunk_tokens(self) -> int | None:
        """The engine's prefill chunk when none is configured (read once, when the engine starts): cpu_max_tokens
        with strategy `cpu`, whose chunks must keep their CPU share (a longer one would run as offload, fetching
        every expert: not what the strategy promises); None otherwise, so that hybrid takes the engine's default
        (4,096), its long chunks running as offload with the prefill prefetch (faster on the H200: 1.07 s against
        7.48 s for a 4K prompt in 512-token chunks at a 25% cache; docs/BENCHMARKS.md)."""
        return self.cpu_max_tokens if self.split_policy.strategy == "cpu" else None

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, partials: bool = False) -> torch.Tensor:
        """`_forward` (always the sum: `partials` is not taken here); if it raises, no slot mapped by this call may be
        read before its copy lands (`forget_slots_after_error`)."""
        try:
            return self._forward(layer_idx, x, topk_ids, topk_weights)
        except BaseException as exc:
            self.forget_slots_after_error(exc)
            raise

    def _forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        T, K = topk_ids.shape
        decode_sized = self.gemm.decode_sized(T * K)
        device_path = self.device_handoff and decode_sized
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
        ready = self.slot_pool.prefetched.pop(layer_idx, None)
        lookahead = self.slot_pool.lookahead
        if lookahead is not None:     # score this layer's prediction, predict the next layer's
            lookahead.begin(layer_idx, x, topk_ids, decode_sized)
        if device_path:
            return self.device_path.forward(layer_idx, x, ids, routes, topk_weights, to_cpu, ready)
        return self.host_path.forward(layer_idx, x, ids, routes, topk_weights, to_cpu, ready)

    def forget_slots_after_error(self, exc: BaseException) -> None:
        """SlotPool.forget_after_error (the side streams joined, the cache emptied); then, for an Exception (not an
        interrupt, which should not block on the workers), the CPU shares the failed call handed over and never
        joined are drained (the next submit into their channel slots would be refused, failing every later step)
        and the device doorbells re-synced with their channels' sequence (host-driven calls moved it; a later
        device ring would reuse a number and could take a stale answer). A worker lost meanwhile degrades the
        backend."""
        self.slot_pool.forget_after_error(exc, self.stats)
        if not isinstance(exc, Exception) or (self.on_cuda and torch.cuda.is_current_stream_capturing()):
            return
        try:
            if self.pool.drain():
                log.warning("drained the CPU shares a failed expert call left in flight")
            self.doorbells.resync()
            if not self.pool.all_serving:
                self._degrade()
        except Exception:                           # noqa: BLE001 - the original error is the one to report
            log.exception("draining the CPU shares after a failed expert call failed too")

    # -- the slot pool's side of ExpertBackend ---------------------------------------------------------
    def set_prefetch(self, settings: PrefetchSettings, predictor: Predictor | None) -> None:
        """The lookahead prefetch (SlotPool.set_prefetch); auto weighs a right guess by `prefetch_saved_share`."""
        self.slot_pool.set_prefetch(settings, predictor, saved_share=self.prefetch_saved_share)

    def prefetch_saved_share(self) -> float:
        """The share of a miss's cost a right prefetch guess takes off a decode step (prefetch_budget.py): all of it
        when every miss is fetched (offload, or the pool down); none under strategy cpu (nothing is fetched, and
        auto does not start fetching); else the fetch fraction f: a hit takes one miss out of the split, and with
        the split balanced (the tuner's aim) a miss costs the layer f x its copy whichever side would have taken
        it."""
        if not self.cpu_active:
            return 1.0
        if self.split_policy.strategy == "cpu":
            return 0.0
        return float(self.split_policy.policy.get("fetch_fraction", 1.0))

    def prefetch_counters(self) -> dict[str, int]:
        return self.slot_pool.prefetch_counters()

    def audit_slots(self, sample_slots: int = 0, probe_slots: int = 0, seed: int = 0) -> list[str]:
        return self.slot_pool.audit(sample_slots, probe_slots, seed)

    def reset_slots(self) -> None:
        self.slot_pool.reset()

    def side_streams(self) -> list:
        """The copy streams (the plan copy's and the split copy's) and the lookahead's predictor stream (CUDA)."""
        return self.slot_pool.side_streams()

    # -- the engine's step and graph hooks ------------------------------------------------------------
    def graph_safe(self, num_pairs: int) -> bool:
        """The engine may capture decode forwards of this size in a CUDA graph (the device hand-off's)."""
        return (self.on_cuda and self.gemm.decode_sized(num_pairs)
                and self.slot_pool.verifier is None)    # the verifier syncs

    def graph_key(self) -> tuple:
        """What a captured decode graph depends on besides shapes: whether misses go to the CPU, whether an
        expert is split, and the doorbells it rings (a graph holds their addresses: new doorbells, new graphs)."""
        lookahead = self.slot_pool.lookahead
        return ("hybrid", self.doorbells.epoch, self.cpu_active, self.splits_experts,
                lookahead.graph_key() if lookahead else ())

    def decode_steps_may_overlap(self) -> bool:
        """No: step_end must see each step's hand-off end (a failed step is re-run) before the next is queued."""
        return False

    def step_may_fail(self) -> bool:
        """Yes: a device hand-off that fails inside the step fails the step (step_end)."""
        return True

    def step_begin(self) -> None:
        """Before a decode step (the engine calls it): re-admit restarted workers, wake the watchdog."""
        if self.degraded and not self._hold_degraded:
            self._readmit()
        self._hold_degraded = False
        self._in_step = True
        self.slot_pool.step_begin()
        self.doorbells.arm()

    def step_end(self) -> bool:
        """After a step's kernels (syncs the stream first): False when a device hand-off failed, which
        marks the worker failed (a late one is killed), clears the flags and switches to offload: the
        caller re-runs the step, which then fetches every miss."""
        self._in_step = False
        self.slot_pool.step_end()
        self.doorbells.disarm()
        return self.device_path.step_ok()

    # -- fallback: a lost CPU share ---------------------------------------------------------------------
    def _degrade(self) -> None:
        if not self.degraded:
            log.warning("CPU pool incomplete: running as offload (every miss fetched) until its workers are back")
        self.degraded = True

    def _fail_step(self) -> None:
        """A decode step's device hand-off failed: offload, and its re-run fetches every miss whatever
        re-admission would say."""
        self._degrade()
        self._hold_degraded = True

    def _readmit(self) -> None:
        for m in self.pool.poll():
            self.stats.cpu_workers[m.name].readmissions_total += 1
            self.doorbells.reset(m.index)     # the client reconnected in poll(); clear the abort word
        if self.pool.all_serving:
            self.degraded = False
            self.stats.readmissions_total += 1
            log.warning("CPU pool complete again: back to %s", self.split_policy.strategy)

    # -- telemetry and life cycle -----------------------------------------------------------------
    def counters(self) -> dict:
        """Cumulative counters (HybridStats fields) with the event timings resolved; plus the mode."""
        self.timer.resolve()
        self.device_path.fold_counters()
        out = {**self.stats.as_dict(), **self.slot_pool.prefetch_counters()}
        out["mode"] = "offload (CPU pool down)" if self.degraded else self.split_policy.strategy
        return out

    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def close(self) -> None:
        self.device_path.close_doorbells()     # before the pool: a doorbell needs its client
        if self.owns_pool:
            self.pool.close()
        if self.owns_host:
            self.host.close()
        self.owns_pool = self.owns_host = False
