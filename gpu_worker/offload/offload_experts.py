"""`OffloadExperts`: every expert in host memory, a slot pool on the GPU, misses fetched per layer.

forward(layer, x, topk_ids, topk_weights):
  1. `ensure` (kernels/slot_cache) marks hits, plans a copy for every miss (fraction 1.0: offload)
     and rewrites the routes to slot ids.
  2. `copy_missing` executes the plan on the copy stream: one DMA of expert_nbytes per miss,
     host store -> slot, ordered after every GEMM already queued (an event on the compute stream)
     so that no slot is overwritten while an earlier layer still reads it.
  3. The expert GEMMs run over slot ids once the copies' event completes, with the same functions
     and the same mode rule as `ResidentExperts` (`pick_mode`: moe_gemv on CUDA for decode-sized
     calls, grouped GEMMs otherwise), so greedy tokens equal the resident backend's.

The plan's length lives on the device; reading it costs one small device-to-host copy per layer
(the DMA engines need host-issued copies). Hybrid splitting (routes left at -1 for the CPU pool)
plugs in at step 3: `cpu_share(...)` below is the seam.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from gpu_worker.models.expert_layout import unpack_experts
from gpu_worker.models.resident_experts import GRAPH_SAFE_MODES, MODES, expert_ffn, pick_mode
from kernels.expert_copy import copy_plan
from kernels.handoff import COUNT_MAX_PAIRS, COUNTERS, count_call
from kernels.moe_decode import CopyPlan, moe_gemv
from kernels.slot_cache import SlotCache, audit, ensure, prefetch_ensure, reset
from kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES
from proto.knobs import env_setting

from .dma_proxy import DmaProxy
from .host_store import HostExperts

log = logging.getLogger(__name__)


def resolve_cache_slots(cache_size: float | int | str | None, num_layers: int, num_experts: int,
                        per_layer: bool = False) -> int:
    """Slots per pool from --moe-cache-size: an int (slots) or a fraction in (0, 1] of all experts."""
    total = num_layers * num_experts
    if cache_size is None:
        cache_size = 0.25
    if isinstance(cache_size, str):
        cache_size = float(cache_size) if "." in cache_size else int(cache_size)
    if isinstance(cache_size, float):
        if not 0.0 < cache_size <= 1.0:
            raise ValueError(f"--moe-cache-size {cache_size} as a fraction must be in (0, 1]; or "
                             f"give a slot count")
        slots = max(1, round(cache_size * total))
    else:
        slots = int(cache_size)
    if per_layer:
        slots = slots // num_layers
    need = num_experts
    if slots < need:
        where = "per layer" if per_layer else "in the pool"
        raise ValueError(f"--moe-cache-size gives {slots} slots {where}, but one prefill call can "
                         f"route all {need} experts of a layer: give at least {need} slots"
                         f"{' per layer' if per_layer else ''} (of {total} experts in all)")
    return slots


MAX_PROXY_STALLS = 8       # stalls of the DMA proxy survived before it is dropped for the kernel copy
COPY_MODES = ("dma", "kernel", "proxy")   # DMA from the host with a plan readback, a device-side copy, or DMA
                                          # of the device-side plan by a host thread (gpu_worker/offload/dma_proxy.py)


def copy_then_ffn(slots: torch.Tensor, host_layer: torch.Tensor, cache: SlotCache, max_copies: int,
                  x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, *, mode: str, kernel_impl: str = "auto",
                  side_stream: "torch.cuda.Stream | None" = None, split_copy: bool = True,
                  after_fork: "Callable[[], None] | None" = None,
                  extra_copy: "Callable[[int], None] | None" = None, extra_slot: int = -1,
                  extra_stream: "torch.cuda.Stream | None" = None, proxy: "DmaProxy | None" = None,
                  layer_idx: int = -1, published: bool = False) -> torch.Tensor:
    """The kernel copy of the last `ensure`'s plan, then the expert FFN over slot ids (routes at -1
    add 0 in the gemv mode). With a `side_stream` (CUDA, gemv mode) the two overlap: the copy runs
    on the side stream while moe_gemv computes the routes whose slot the plan does not fill (the
    hits), then the compute stream waits for the copy and moe_gemv computes the fetched routes
    (`kernels.moe_decode.CopyPlan`). With `split_copy` the copy goes in two parts, every planned
    expert's w13 and then every one's w2 (`copy_plan(cols=...)`): the fetched routes' gate/up waits
    for the first part only and runs while the w2 rows are still crossing the link, so after the last
    byte lands only their down and the sum are left. Bit-identical to the serial order either way
    (the same launches read the same bytes); graph-capturable (the side stream forks from and joins
    the capturing stream). `after_fork` (the counters, the CPU hand-off's rings) runs on the compute
    stream right after the copy is launched, beside it; without the overlap, before the copy. It must
    not read or write the slots, nor write the plan, the routes or x. If it raises after the fork, the
    side stream is joined and the error re-raised; without the overlap it raises before the copy, and
    the layer's slots that `ensure` just mapped are left unfilled (as when any launch fails there).
    `extra_copy(part)` (the hybrid backend's split expert, kernels/expert_split) fills pool row `extra_slot`:
    part 0 (w13), then part 1 (w2). With the overlap it runs on `extra_stream` (forked beside the plan copy,
    so the two share the link instead of queueing: measured on the H200, the split copy between the plan's
    parts left a 69 us gap a layer in the plan's stream), else on the side stream after the plan's parts; the
    routes at `extra_slot` wait for it as the fetched ones wait for the plan.
    `proxy` (copy mode proxy; not with `extra_copy`): the plan goes to the DMA proxy instead of the copy kernel
    (published on the compute stream after `ensure`, no side stream); the fetched routes' gate/up and down wait
    for its parts as they would for the copy's (the proxy lands w13 first when it splits); `published`: the plan
    was handed to it already (`OffloadExperts.early_plan`)."""
    c = cache
    if proxy is not None:
        return _proxy_then_ffn(proxy, layer_idx, cache, max_copies, x, slot_ids, weights, w13, w2, mode=mode,
                               kernel_impl=kernel_impl, overlap=side_stream is not None and mode == "gemv",
                               after_fork=after_fork, published=published)
    own_stream = extra_copy is not None and extra_stream is not None

    def copy(cols: tuple[int, int] | None = None) -> None:
        copy_plan(slots, host_layer, c.evict_slots, c.src_indices, c.num_indices, max_copies=max_copies, cols=cols)
        if extra_copy is not None and not own_stream:
            for part in ((0, 1) if cols is None else (0,) if cols[0] == 0 else (1,)):
                extra_copy(part)

    if side_stream is None or mode != "gemv":
        if after_fork is not None:
            after_fork()
        copy()
        if own_stream:
            extra_copy(0)
            extra_copy(1)
        return expert_ffn(mode, x, slot_ids, weights, w13, w2, kernel_impl=kernel_impl)
    compute = torch.cuda.current_stream(x.device)
    w13_cols = w13[0].numel() if split_copy and w13.data_ptr() == slots.data_ptr() else 0
    extra_w13 = None

    def all_landed() -> None:
        compute.wait_stream(side_stream)
        if own_stream:
            compute.wait_stream(extra_stream)

    def w13_in() -> None:
        compute.wait_event(w13_landed)
        if extra_w13 is not None:
            compute.wait_event(extra_w13)

    side_stream.wait_stream(compute)            # ensure (and every GEMM reading the old slots) first
    if own_stream:
        extra_stream.wait_stream(compute)
    try:                                        # from the fork on: whatever raises, the side streams join
        if own_stream:
            with torch.cuda.stream(extra_stream):
                extra_copy(0)
                if w13_cols:
                    extra_w13 = torch.cuda.Event()
                    extra_w13.record(extra_stream)
                extra_copy(1)
        with torch.cuda.stream(side_stream):
            if w13_cols:                        # w13 is the first part of a packed row (expert_layout)
                copy((0, w13_cols))
                w13_landed = torch.cuda.Event()
                w13_landed.record(side_stream)
                copy((w13_cols, slots.shape[1]))
            else:
                copy()
        if after_fork is not None:
            after_fork()
        return moe_gemv(x, slot_ids, weights, w13, w2, impl=kernel_impl,
                        plan=CopyPlan(c.evict_slots, c.num_indices, max_copies, extra_slot=extra_slot),
                        between=w13_in if w13_cols else all_landed,
                        between_down=all_landed if w13_cols else None)
    except BaseException:                       # raised, perhaps before the wait: join anyway, so nothing
        all_landed()                            # later runs beside the copy (and a capture can end)
        raise


def _proxy_then_ffn(proxy: "DmaProxy", layer_idx: int, cache: SlotCache, max_copies: int, x: torch.Tensor,
                    slot_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, mode: str,
                    kernel_impl: str, overlap: bool, after_fork: "Callable[[], None] | None",
                    published: bool = False) -> torch.Tensor:
    """copy_then_ffn with the DMA proxy: publish the plan, then the hits' GEMMs beside the DMAs (overlap), then
    the fetched routes' after their parts landed; without the overlap, wait for all of it, then every GEMM.
    `published`: the plan was published already (`OffloadExperts.early_plan`, before the layer's attention)."""
    c = cache
    plan = (c.evict_slots, c.src_indices, c.num_indices)
    if not published:
        proxy.publish(layer_idx, *plan)
    if after_fork is not None:
        after_fork()
    split = proxy.split_cols > 0

    def landed(part: int) -> Callable[[], None]:
        return lambda: proxy.wait(part, layer_idx, *plan)

    if not overlap:
        landed(0)()
        landed(1)()
        return expert_ffn(mode, x, slot_ids, weights, w13, w2, kernel_impl=kernel_impl)
    return moe_gemv(x, slot_ids, weights, w13, w2, impl=kernel_impl,
                    plan=CopyPlan(c.evict_slots, c.num_indices, max_copies),
                    between=landed(0) if split else landed(1), between_down=landed(1) if split else None)


@dataclass
class OffloadStats:
    calls: int = 0
    routed_pairs: int = 0       # (token, expert) routes seen
    distinct_misses: int = 0    # distinct experts missing, summed over calls
    fetched: int = 0            # experts copied host -> GPU (demand and prefetch)
    copy_bytes: int = 0
    prefetched: int = 0         # of those, copied ahead for the next layer during prefill
    resets_after_error: int = 0  # the cache emptied after a call that raised (forget_slots_after_error)
    proxy_failures: int = 0     # the DMA proxy dropped for the kernel copy (an error, or stalls past MAX_PROXY_STALLS)
    proxy_stalls: int = 0       # the DMA proxy late past its deadline and kept (its steps re-run)
    early_plans: int = 0        # layer calls whose plan was published before their attention (early_plan)


class SlotPoolAudit:
    """The slot audit (FREETOKEN_MOE_SLOT_AUDIT) of a backend with a slot cache `cache`, its pool `slots` [S, N]
    and host rows `host.layers[l]` [E, N]: the offload and hybrid backends. Also their `forward`, which runs the
    backend's `_forward` and empties the cache when it raises."""

    def audit_slots(self, sample_slots: int = 0, probe_slots: int = 0, seed: int = 0) -> list[str]:
        """kernels.slot_cache.audit over this backend's cache and pool: the problems found (empty: none)."""
        # the cache's slots only: a backend may keep rows of its own past them (the hybrid split slot)
        return audit(self.cache, slots=self.slots[:self.cache.total_slots], host_layers=self.host.layers,
                     sample_slots=sample_slots, probe_slots=probe_slots, seed=seed)

    def reset_slots(self) -> None:
        """Empty the slot cache in place (the pool's bytes stay, unmapped): later calls fetch again."""
        reset(self.cache)

    def side_streams(self) -> list:
        """The CUDA streams besides the compute stream that this backend's copies (or hand-offs) run on."""
        return [self.copy_stream] if self.on_cuda else []

    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """The backend's `_forward`; if it raises, no slot mapped by this call may be read before its copy lands
        (`forget_slots_after_error`)."""
        try:
            return self._forward(layer_idx, x, topk_ids, topk_weights)
        except BaseException as exc:
            self.forget_slots_after_error(exc)
            raise

    def _settle_side_work(self) -> None:
        """Before the cache is emptied after an error: let copies issued outside the CUDA streams land (none here)."""

    def forget_slots_after_error(self, exc: BaseException) -> None:
        """A call that raised after its `ensure` (or `prefetch_ensure`) may leave slots mapped whose copies never ran;
        a later call would read them as hits and compute with the bytes of whatever expert was there before. So
        the cache is emptied (later calls fetch again: slower for a while, never wrong) and the next layers' pending
        prefetch events forgotten. Nothing to undo while a CUDA graph is being captured (nothing ran); a reset that
        fails too (a broken device context) is logged, and the call's own error is what propagates."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        try:
            if self.device.type == "cuda":
                # copies still in flight on the side streams (a prefill's prefetch, whose event is forgotten below)
                # must land before anything later can map and fill those slots from the compute stream
                compute = torch.cuda.current_stream(self.device)
                for stream in self.side_streams():
                    compute.wait_stream(stream)
            try:
                self._settle_side_work()            # e.g. the DMA proxy's copies land before the slots are re-mapped
            finally:
                reset(self.cache)
            self._prefetched.clear()
            self._early = None
            self.stats.resets_after_error += 1
            log.warning("an expert call failed (%s: %s); the slot cache was emptied so that no slot mapped by it is "
                        "read before its copy lands", type(exc).__name__, exc)
        except Exception:                           # noqa: BLE001 - the original error is the one to report
            log.exception("emptying the slot cache after a failed expert call failed too")


def prefill_prefetch_layer(layer_idx: int, num_pairs: int, num_experts: int, num_layers: int,
                           gather_max_pairs: int) -> int | None:
    """The layer whose experts a call streams behind its own with the prefill prefetch: the next one, when the call
    routes at least num_experts pairs and is not decode-sized (a prefill chunk, which routes to most experts)."""
    prefill = num_pairs >= num_experts and num_pairs > gather_max_pairs
    return layer_idx + 1 if prefill and layer_idx + 1 < num_layers else None


def eviction_settings(freq_weight: int | None, freq_half_life: int | None) -> dict:
    """SlotCache.create's eviction arguments: those given, else the knobs (FREETOKEN_EVICTION_FREQ_WEIGHT and
    FREETOKEN_EVICTION_FREQ_HALF_LIFE)."""
    return dict(freq_weight=env_setting("eviction_freq_weight") if freq_weight is None else freq_weight,
                freq_half_life=env_setting("eviction_freq_half_life") if freq_half_life is None else freq_half_life)


class OffloadExperts(SlotPoolAudit):
    """Expert backend over a GPU slot pool; see the module docstring."""

    def __init__(self, host: HostExperts, num_slots: int, device: torch.device | str, *,
                 per_layer: bool = False, mode: str = "auto", gather_max_pairs: int = 32,
                 copy_mode: str = "dma", prefill_prefetch: bool | None = None, overlap_copy: bool = True,
                 split_copy: bool = True, freq_weight: int | None = None, freq_half_life: int | None = None):
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        if copy_mode not in COPY_MODES:
            raise ValueError(f"copy mode {copy_mode!r} is not one of {', '.join(COPY_MODES)}")
        self.copy_mode = copy_mode
        # kernel copy mode, decode-sized (gemv) calls on CUDA: the copy on copy_stream beside the hits'
        # GEMMs (copy_then_ffn); False: copy, then every GEMM, on one stream
        self.overlap_copy = overlap_copy
        # with overlap_copy: copy w13 then w2, the fetched routes' gate/up between them (copy_then_ffn)
        self.split_copy = split_copy
        # prefill calls (a chunk routes to most experts) copy the next layer's experts while this layer
        # computes: see `forward`. None: the knob (FREETOKEN_PREFILL_PREFETCH, --prefill-prefetch; default on)
        if prefill_prefetch is None:
            prefill_prefetch = env_setting("prefill_prefetch") == "on"
        self.prefill_prefetch = bool(prefill_prefetch)
        self.host, self.layout = host, host.layout
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        self.device = torch.device(device)
        self.mode, self.gather_max_pairs = mode, gather_max_pairs
        self.kernel_impl = "auto"     # moe_gemv: Triton on CUDA, reference on CPU ("triton": tests)
        # the eviction key's frequency weight and the counts' half-life (None: the knobs
        # FREETOKEN_EVICTION_FREQ_WEIGHT, default 0 = LRU, and FREETOKEN_EVICTION_FREQ_HALF_LIFE)
        self.cache = SlotCache.create(self.num_layers, self.num_experts, num_slots,
                                      device=self.device, per_layer=per_layer, **eviction_settings(freq_weight,
                                                                                                  freq_half_life))
        # slots: [S_total, N], the GPU copies of experts, in the same packed layout as the host
        self.slots = self.layout.empty_layer(self.cache.total_slots, device=self.device)
        self.w13, self.w2 = unpack_experts(self.slots, self.layout)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self._plan_host = torch.empty(3 + 4 * num_slots, dtype=torch.int32, pin_memory=True)
        # copy mode proxy: the plan's DMAs issued by a host thread (w13 first when the copy splits)
        self._proxy: DmaProxy | None = None
        if copy_mode == "proxy":
            split = self.w13[0].numel() if split_copy and self.w13.data_ptr() == self.slots.data_ptr() else 0
            self._proxy = DmaProxy(self.slots, self.host.layers, split_cols=split,
                                   max_pairs=min(self.cache.total_slots, self.num_experts))
        self.stats = OffloadStats()
        self._host_counts = [0, 0, 0]      # kernel copy mode: [fetched, misses, calls] of DMA calls
        # prefill prefetch: layer -> event after its experts' copies (the layer's GEMMs wait on it)
        self._prefetched: dict[int, torch.cuda.Event] = {}
        self._candidates = torch.arange(min(self.num_experts, MAX_PREFETCH_CANDIDATES),
                                        dtype=torch.int64, device=self.device)
        # kernel copy mode counts on the device (no host sync): [fetched, distinct misses, calls, ...], the
        # layout of kernels.handoff.count_call (one launch a layer on CUDA instead of three adds)
        # (row 1: the same counts of calls on the DMA path, of which only the hits are read: the host counts the rest)
        self._counts = torch.zeros(2, COUNTERS, dtype=torch.int64, device=self.device)
        self._device_counts, self._dma_counts = self._counts[0], self._counts[1]
        self._count_kernel = self.on_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self.copy_time_s = 0.0
        self._early: tuple[int, torch.Tensor] | None = None      # (layer, slot ids) of a plan early_plan published

    @property
    def expert_nbytes(self) -> int:
        return self.layout.expert_nbytes

    def _forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        early, self._early = self._early, None
        if early is not None:
            if early[0] != layer_idx or early[1].shape != topk_ids.shape:
                raise RuntimeError(f"layer {layer_idx} was called with other routes than early_plan was given (layer "
                                   f"{early[0]}, {tuple(early[1].shape)} routes): the plan already published does not "
                                   "fit them; call early_plan with the routes the layer will use")
            self.stats.early_plans += 1
            return self._copy_then_ffn(layer_idx, x, topk_ids, early[1], topk_weights, published=True)
        self._settle_failed_proxy()
        slot_ids = topk_ids.to(torch.int64, copy=True).contiguous()      # [T, K] -> slot ids
        # A prefill chunk routes to most experts of every layer: with prefill_prefetch, stream the
        # next layer's experts (a low-priority prefetch of all of them, never evicting this layer's)
        # on the copy stream behind this layer's own copies, so they land while this layer and the
        # next one's attention compute. That needs the DMA path; everything else keeps its copy mode.
        nxt = prefill_prefetch_layer(layer_idx, slot_ids.numel(), self.num_experts, self.num_layers,
                                     self.gather_max_pairs) if self.prefill_prefetch else None
        ensure(self.cache, layer_idx, slot_ids, fetch_fraction=1.0, check_ids=False)
        if not (self.copy_mode in ("kernel", "proxy") and nxt is None):
            self._count_on_device(topk_ids, self._dma_counts)  # the DMA path counts on the host; hits only here
        if nxt is not None:
            prefetch_ensure(self.cache, nxt, self._candidates, self._candidates.numel(), check_ids=False)
        # experts a prefill prefetched for this layer (DMA on copy_stream): the GEMMs read them and a
        # kernel copy may evict them, so both wait for their event
        ready = self._prefetched.pop(layer_idx, None)
        if self.copy_mode in ("kernel", "proxy") and nxt is None:
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            return self._copy_then_ffn(layer_idx, x, topk_ids, slot_ids, topk_weights)
        mode = pick_mode(self.mode, self.on_cuda, slot_ids.numel(), self.gather_max_pairs)
        self.stats.routed_pairs += slot_ids.numel()
        self.copy_missing(layer_idx, prefetch_layer=nxt)     # (its plan readback does not wait for `ready`;
        self.stats.calls += 1                                # its copies queue behind it on copy_stream)
        self._host_counts[2] += 1
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return expert_ffn(mode, x, slot_ids, topk_weights, self.w13, self.w2, kernel_impl=self.kernel_impl)

    def _settle_failed_proxy(self) -> None:
        if (self.copy_mode == "proxy" and self._proxy.failed()
                and not (self.on_cuda and torch.cuda.is_current_stream_capturing())):
            # an eager call (a prefill chunk, eager decode) after an earlier one gave up on the proxy: those waits
            # copied and were correct, but nothing re-runs them, so settle it here, before this call maps any slot
            # (decode steps: step_end)
            self._proxy_failed()

    def early_plan(self, layer_idx: int, topk_ids: torch.Tensor) -> bool:
        """Copies that start before the layer has chosen its experts: with routes known before the layer's attention
        (`MoeModel.routing_ahead`: the benchmarks' synthetic table, so a perfect prediction), make the layer's plan
        (`ensure`) and hand it to the DMA proxy now; the layer's `forward`, which must get the same routes, then runs
        only its GEMMs and waits. The bound that any router prediction could reach (docs/OFFLOAD.md). Copy mode proxy,
        decode-sized calls only; False (nothing done: `forward` plans as usual) otherwise."""
        self._early = None          # one a forward did not take (it raised before this layer's experts): its copies
        # were published, and land; the slots it mapped hold their experts then. Decode-sized calls only: a prefill
        # chunk's layers (the last one too, which prefetches nothing) may read experts a prefill prefetch is copying
        if (self.copy_mode != "proxy" or topk_ids.numel() > self.gather_max_pairs or layer_idx in self._prefetched):
            return False
        try:
            self._settle_failed_proxy()
            if self.copy_mode != "proxy":            # just given up on
                return False
            slot_ids = topk_ids.to(torch.int64, copy=True).contiguous()
            ensure(self.cache, layer_idx, slot_ids, fetch_fraction=1.0, check_ids=False)
            c = self.cache
            self._proxy.publish(layer_idx, c.evict_slots, c.src_indices, c.num_indices)
        except BaseException as exc:
            self.forget_slots_after_error(exc)
            raise
        self._early = (layer_idx, slot_ids)
        return True

    def _copy_then_ffn(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor, slot_ids: torch.Tensor,
                       topk_weights: torch.Tensor, published: bool = False) -> torch.Tensor:
        """The kernel or proxy copy of the last `ensure`'s plan (`published`: handed to the proxy already, by
        `early_plan`), then the expert FFN over `slot_ids` (copy_then_ffn)."""
        mode = pick_mode(self.mode, self.on_cuda, slot_ids.numel(), self.gather_max_pairs)
        self.stats.routed_pairs += slot_ids.numel()
        max_copies = min(slot_ids.numel(), self.cache.num_slots)
        return copy_then_ffn(self.slots, self.host.layers[layer_idx], self.cache, max_copies, x, slot_ids,
                             topk_weights, self.w13, self.w2, mode=mode, kernel_impl=self.kernel_impl,
                             side_stream=self.copy_stream if self.on_cuda and self.overlap_copy else None,
                             split_copy=self.split_copy, after_fork=lambda: self._count_on_device(topk_ids),
                             proxy=self._proxy if self.copy_mode == "proxy" else None, layer_idx=layer_idx,
                             published=published)

    def graph_safe(self, num_pairs: int) -> bool:
        """Capturable in a CUDA graph: device-side copies and the gemv- or gather-mode GEMMs."""
        return (self.copy_mode in ("kernel", "proxy") and self.on_cuda
                and self.mode in ("auto", *GRAPH_SAFE_MODES) and num_pairs <= self.gather_max_pairs)

    def graph_key(self) -> tuple:
        """A captured decode graph holds the copy mode's kernels: a change of mode (the proxy given up) needs new ones."""
        return ("offload", self.copy_mode)

    @property
    def decode_steps_may_overlap(self) -> bool:
        """The engine may queue the next decode step before this one's tokens are read (EngineConfig.overlap_decode)
        unless the DMA proxy's `step_end` must see each step end first."""
        return self.copy_mode != "proxy"

    def step_end(self) -> bool:
        """After a decode step (the engine calls it): with the DMA proxy, whether its copies all landed (a device
        sync, then one host word). If a wait gave up on it, that step copied the rest itself and is correct, but a
        late copy may still land: `_proxy_failed` settles that, and False has the engine run the step again."""
        proxy = self._proxy
        if proxy is None or self.copy_mode != "proxy":
            return True
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        if not proxy.failed():
            return True
        self._proxy_failed()
        return False

    def _proxy_failed(self) -> None:
        """A wait gave up on the proxy (its flag is raised; the device work before it has run). A stall (the thread
        alive, no error: seen once on the H200, docs/OFFLOAD.md) is survived: once everything the thread was handed
        has landed, the cache is emptied (a late copy may have landed in a slot mapped again since), the flags are
        cleared and the proxy stays, up to MAX_PROXY_STALLS times. An error, a thread that does not catch up within
        QUIESCE_S, or one stall too many drops it for the kernel copy (`_drop_proxy`)."""
        proxy = self._proxy
        reason = proxy.failure_reason()
        if proxy.stalled() and self.stats.proxy_stalls < MAX_PROXY_STALLS and proxy.quiesce():
            reset(self.cache)
            proxy.clear_failure()
            self.stats.proxy_stalls += 1
            log.warning("the DMA proxy stalled (%s); its copies have landed since, the slot cache was emptied and it "
                        "stays in use (stall %d of at most %d)", reason, self.stats.proxy_stalls, MAX_PROXY_STALLS)
            return
        self._drop_proxy(reason)

    def _drop_proxy(self, reason: str) -> None:
        """Give up on the DMA proxy: stop its thread once what it issued has landed (a stalled one may land a copy
        late, so only then), empty the cache, and copy with the kernel from now on (new graphs: `graph_key`)."""
        log.error("the DMA proxy failed (%s); offload copies by the copy kernel from now on", reason)
        proxy = self._proxy
        try:
            proxy.quiesce()
            proxy.close()
        finally:
            self.copy_mode = "kernel"
            reset(self.cache)
            self.stats.proxy_failures += 1

    def _settle_side_work(self) -> None:
        proxy = self._proxy
        if proxy is not None and self.copy_mode == "proxy" and not proxy.quiesce():
            self._drop_proxy("what it was handed did not land within its deadline")

    def _count_on_device(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """The kernel copy mode's counters, on the device (reads the plan `ensure` just wrote), into `counts`
        (default: `_device_counts`): kernels.handoff.count_call's layout."""
        c = self.cache
        counts = self._device_counts if counts is None else counts
        if self._count_kernel and ids.numel() <= COUNT_MAX_PAIRS:
            count_call(counts, ids, c.num_indices, c.num_missing_full, offload=False)
        else:                           # no Triton kernel on a CPU outside the interpreter; large calls
            counts[0] += c.num_indices[0]
            counts[1] += c.num_missing_full[0]
            counts[2] += 1
            counts[4] += ids.numel()
            counts[5] += torch.unique(ids[ids >= 0]).numel() - c.num_missing_full[0]     # distinct hits

    def refresh_stats(self, counts: list[list[int]] | None = None) -> OffloadStats:
        """Fold the device-side counters of the kernel copy mode into `stats` (a device sync; `counts`: a
        `_counts.tolist()` the caller already read)."""
        if self.copy_mode in ("kernel", "proxy"):
            counts = self._counts.tolist() if counts is None else counts
            fetched, misses, calls = (int(v) + h for v, h in zip(counts[0][:3], self._host_counts))
            self.stats.fetched, self.stats.distinct_misses, self.stats.calls = fetched, misses, calls
            self.stats.copy_bytes = fetched * self.expert_nbytes
        return self.stats

    def counters(self) -> dict:
        """Cumulative counters under the engine's names (EngineStats, the /metrics expert figures), after each
        step: hits and misses (distinct experts of a layer call found in a slot, or not), experts fetched and
        their bytes, the copy-stream time (DMA mode; the kernel and proxy copies run untimed) and, with the proxy,
        the GPU's time waiting for its copies as `proxy_wait_s_total` (not `gpu_wait_for_copy_s_total`, which the
        hybrid tuner weighs against the CPU's wait). One small device read (two with the proxy)."""
        counts = self._counts.tolist()
        self.collect_copy_time(counts)                    # (refreshes stats from the same read)
        st = self.stats
        out = {"expert_hits_total": int(counts[0][5] + counts[1][5]), "expert_misses_total": st.distinct_misses,
               "experts_fetched_total": st.fetched, "copy_bytes_total": st.copy_bytes,
               "copy_time_s_total": self.copy_time_s, "mode": "offload",
               "copy_mode": self.copy_mode, "resets_after_error": st.resets_after_error,
               "proxy_stalls": st.proxy_stalls, "proxy_failures": st.proxy_failures}
        if self._proxy is not None:
            out["proxy_wait_s_total"] = self._proxy.counters()["wait_ns"] / 1e9
        return out

    def _read_plan(self, prefetch: bool = False) -> tuple[int, int, list[int], list[int], list[int], list[int]]:
        """(copies, distinct misses, destination slots, source rows, and the prefetch plan's
        destination slots and source rows when `prefetch`): one small D2H copy and one sync."""
        c = self.cache
        if not self.on_cuda:
            n, p = int(c.num_indices), int(c.prefetch_num_indices) if prefetch else 0
            return (n, int(c.num_missing_full), c.evict_slots[:n].tolist(), c.src_indices[:n].tolist(),
                    c.prefetch_evict_slots[:p].tolist(), c.prefetch_src_indices[:p].tolist())
        s = c.num_slots
        buf = self._plan_host
        buf[0:1].copy_(c.num_indices, non_blocking=True)
        buf[1:2].copy_(c.num_missing_full, non_blocking=True)
        buf[3:3 + s].copy_(c.evict_slots, non_blocking=True)
        buf[3 + s:3 + 2 * s].copy_(c.src_indices, non_blocking=True)
        if prefetch:
            buf[2:3].copy_(c.prefetch_num_indices, non_blocking=True)
            buf[3 + 2 * s:3 + 3 * s].copy_(c.prefetch_evict_slots, non_blocking=True)
            buf[3 + 3 * s:3 + 4 * s].copy_(c.prefetch_src_indices, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        n, p = int(buf[0]), int(buf[2]) if prefetch else 0
        return (n, int(buf[1]), buf[3:3 + n].tolist(), buf[3 + s:3 + s + n].tolist(),
                buf[3 + 2 * s:3 + 2 * s + p].tolist(), buf[3 + 3 * s:3 + 3 * s + p].tolist())

    def copy_missing(self, layer_idx: int, prefetch_layer: int | None = None) -> None:
        """Execute the copy plan of the last `ensure` (host store -> slots); with `prefetch_layer`,
        then the plan of the `prefetch_ensure` made for that layer, behind it on the copy stream."""
        n, misses, dst, src, pdst, psrc = self._read_plan(prefetch=prefetch_layer is not None)
        st = self.stats
        st.distinct_misses += misses
        st.fetched += n + len(pdst)
        st.prefetched += len(pdst)
        st.copy_bytes += (n + len(pdst)) * self.expert_nbytes
        self._host_counts[0] += n + len(pdst)
        self._host_counts[1] += misses
        if n == 0 and not pdst:
            return
        jobs = [(self.host.layers[layer_idx], dst, src)]                  # [E, N] host rows
        if pdst:
            jobs.append((self.host.layers[prefetch_layer], pdst, psrc))
        if not self.on_cuda:
            for host_layer, dsts, srcs in jobs:
                for d, s in zip(dsts, srcs):
                    self.slots[d].copy_(host_layer[s])
            return
        compute = torch.cuda.current_stream(self.device)
        queued = torch.cuda.Event()
        queued.record(compute)                     # every GEMM already queued reads its slot first
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(queued)
            start.record(self.copy_stream)
            host_layer, dsts, srcs = jobs[0]
            for d, s in zip(dsts, srcs):
                self.slots[d].copy_(host_layer[s], non_blocking=True)
            done.record(self.copy_stream)
            last = done
            if pdst:
                host_layer, dsts, srcs = jobs[1]
                for d, s in zip(dsts, srcs):
                    self.slots[d].copy_(host_layer[s], non_blocking=True)
                last = torch.cuda.Event(enable_timing=True)
                last.record(self.copy_stream)
                self._prefetched[prefetch_layer] = last
        compute.wait_event(done)                   # this layer's experts; the prefetch runs on
        self._copy_events.append((start, last, n + len(pdst)))

    def collect_copy_time(self, counts: list[list[int]] | None = None) -> float:
        """Seconds the copy stream spent on copies so far (syncs on outstanding events); also
        refreshes `stats` (`refresh_stats(counts)`). The kernel copy mode copies on the compute stream: no
        separate time."""
        self.refresh_stats(counts)
        for start, done, _ in self._copy_events:
            done.synchronize()
            self.copy_time_s += start.elapsed_time(done) / 1e3
        self._copy_events.clear()
        return self.copy_time_s

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.close()
        self.host.close()
