"""`OffloadExperts`: every expert in host memory, a slot pool on the GPU, misses fetched per layer.

forward(layer, x, topk_ids, topk_weights):
  1. `ensure` (kernels/slot_cache) marks hits, plans a copy for every miss (fraction 1.0: offload)
     and rewrites the routes to slot ids.
  2. The plan's copies, two ways by the call's size:
     - decode-sized calls (at most gather_max_pairs routes): the device copy kernel on the copy stream beside the
       hits' GEMMs (`DecodeCopy`, decode_copy.py): no host sync, so a decode step runs in a CUDA graph;
     - larger calls (prefill chunks, which route to most experts): `copy_missing` reads the plan on the host and
       issues one DMA of expert_nbytes per miss on the copy stream, ordered after every GEMM already queued (so
       that no slot is overwritten while an earlier layer still reads it), and streams the next layer's experts
       behind them (`prefetch_ensure`: a low-priority prefetch of all of them, never evicting this layer's), so
       they land while this layer and the next one's attention compute.
  3. The expert GEMMs run over slot ids once their copies landed, with the same functions and the same mode rule
     as `ResidentExperts` (`pick_mode`: moe_gemv on CUDA for decode-sized calls, grouped GEMMs otherwise), so
     greedy tokens equal the resident backend's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.backends.expert_math import expert_rows
from ftexpert.gpu_worker.backends.expert_compute import GRAPH_SAFE_MODES, MODES, pick_mode
from ftexpert.kernels.handoff import COUNT_MAX_PAIRS, COUNTERS, count_call
from ftexpert.kernels.slot_cache import SlotCache, ensure, prefetch_ensure
from ftexpert.kernels.slot_cache.api import MAX_PREFETCH_CANDIDATES

from ftexpert.gpu_worker.backends.offload.decode_copy import CopyTimer, DecodeCopy
from ftexpert.gpu_worker.backends.offload.host_store import HostExperts
from ftexpert.gpu_worker.backends.offload.prefetch import Lookahead, PrefetchSettings, Predictor
from ftexpert.gpu_worker.backends.offload.slot_pool import SlotPool, eviction_settings, prefill_prefetch_layer
from ftexpert.gpu_worker.backends.offload.verify import SlotVerifier


@dataclass
class OffloadStats:
    calls: int = 0
    routed_pairs: int = 0       # (token, expert) routes seen
    distinct_misses: int = 0    # distinct experts missing, summed over calls
    fetched: int = 0            # experts copied host -> GPU (demand and prefetch)
    copy_bytes: int = 0
    prefetched: int = 0         # of those, copied ahead for the next layer during prefill
    resets_after_error: int = 0  # the cache emptied after a call that raised (forget_slots_after_error)


class OffloadExperts(ExpertBackend):
    """Expert backend over a GPU slot pool (`slot_pool`: the cache, the pool, the prefetch and the audit over them);
    see the module docstring."""

    has_slot_cache = True

    def __init__(self, host: HostExperts, num_slots: int, device: torch.device | str, *,
                 per_layer: bool = False, mode: str = "auto", gather_max_pairs: int = 32,
                 split_copy: bool = True, freq_weight: int | None = None, freq_half_life: int | None = None,
                 owns_host: bool = True):
        """split_copy: the decode copy in two parts, w13 then w2, the fetched routes' gate/up between them
        (DecodeCopy). freq_weight / freq_half_life: the eviction key's frequency weight and the counts' half-life
        (None: the knobs FREETOKEN_EVICTION_FREQ_WEIGHT and FREETOKEN_EVICTION_FREQ_HALF_LIFE). owns_host: `close`
        closes `host` too (False: it is shared, e.g. by a benchmark's backends, and its owner closes it)."""
        if mode not in MODES:
            raise ValueError(f"expert compute mode {mode!r} is not one of {', '.join(MODES)}")
        self.host, self.layout, self.owns_host = host, host.layout, owns_host
        self.num_layers, self.num_experts = host.num_layers, host.num_experts
        self.device = torch.device(device)
        self.mode, self.gather_max_pairs = mode, gather_max_pairs
        self.cache = SlotCache.create(self.num_layers, self.num_experts, num_slots, device=self.device,
                                      per_layer=per_layer, **eviction_settings(freq_weight, freq_half_life))
        # slots: [S_total, N], the GPU copies of experts, in the same packed layout (and format) as the host
        self.slots = self.layout.empty_layer(self.cache.total_slots, device=self.device)
        self.rows = expert_rows(self.slots, self.layout)          # the expert math over the slots

        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.slot_pool = SlotPool(self.cache, self.slots, self.host.layers, self.device, self.copy_stream)
        if self.on_cuda:
            self._plan_host = torch.empty(3 + 4 * num_slots, dtype=torch.int32, pin_memory=True)
        self.timer = CopyTimer(self.num_layers, self.on_cuda)
        self.copy = DecodeCopy(self.slots, self.host.layers, self.cache, self.rows, stream=self.copy_stream,
                               split=split_copy, timer=self.timer)
        self.stats = OffloadStats()
        self._host_counts = [0, 0, 0]      # [fetched, misses, calls] of the DMA path's calls
        # prefill prefetch: slot_pool.prefetched, layer -> event after its experts' copies (its GEMMs wait on it)
        self._candidates = torch.arange(min(self.num_experts, MAX_PREFETCH_CANDIDATES),
                                        dtype=torch.int64, device=self.device)
        # counts on the device (no host sync): [fetched, distinct misses, calls, ...], the layout of
        # kernels.handoff.count_call (one launch a layer on CUDA instead of three adds); row 0: the decode copy's
        # calls, row 1: the same counts of the DMA path's calls, of which only the hits are read (the host counts
        # the rest)
        self._counts = torch.zeros(2, COUNTERS, dtype=torch.int64, device=self.device)
        self._device_counts, self._dma_counts = self._counts[0], self._counts[1]
        self._count_kernel = self.on_cuda or os.environ.get("TRITON_INTERPRET") == "1"

    @property
    def kernel_impl(self) -> str:
        """moe_gemv's impl: auto (Triton on CUDA, reference on CPU) or triton (tests)."""
        return self.copy.kernel_impl

    @kernel_impl.setter
    def kernel_impl(self, value: str) -> None:
        self.copy.kernel_impl = value

    @property
    def lookahead(self) -> Lookahead | None:
        """The lookahead prefetch (slot_pool's; set_prefetch)."""
        return self.slot_pool.lookahead

    @property
    def verifier(self) -> SlotVerifier | None:
        """FREETOKEN_MOE_PREFETCH_VERIFY's checker (slot_pool's; None: off)."""
        return self.slot_pool.verifier

    def _decode_sized(self, num_pairs: int) -> bool:
        return num_pairs <= self.gather_max_pairs

    def forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, partials: bool = False) -> torch.Tensor:
        """`_forward` (always the sum: `partials` is not taken here); if it raises, no slot mapped by this call may be
        read before its copy lands (`forget_slots_after_error`)."""
        try:
            return self._forward(layer_idx, x, topk_ids, topk_weights)
        except BaseException as exc:
            self.forget_slots_after_error(exc)
            raise

    def forget_slots_after_error(self, exc: BaseException) -> None:
        """SlotPool.forget_after_error: the side streams joined, the cache emptied."""
        self.slot_pool.forget_after_error(exc, self.stats)

    def _forward(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        slot_ids = topk_ids.to(torch.int64, copy=True).contiguous()      # [T, K] -> slot ids
        n = slot_ids.numel()
        mode = pick_mode(self.mode, self.on_cuda, n, self.gather_max_pairs)
        self.stats.routed_pairs += n
        la = self.lookahead
        if la is not None:                  # score this layer's prediction, predict the next layer's
            la.begin(layer_idx, x, topk_ids, self._decode_sized(n))
        ensure(self.cache, layer_idx, slot_ids, fetch_fraction=1.0, check_ids=False)
        # experts a prefill prefetched for this layer (DMA on copy_stream): the GEMMs read them and a
        # decode copy may evict them, so both wait for their event
        ready = self.slot_pool.prefetched.pop(layer_idx, None)
        if self._decode_sized(n):
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            # this layer's prefetch copy waited for (before its GEMMs and the next install); the next layer's
            # prefetch installed once this layer's demand copy is launched, beside it
            self.slot_pool.wait_prefetch(layer_idx)
            self.slot_pool.verify(layer_idx, topk_ids, slot_ids)

            def after_fork() -> None:
                self._count_on_device(topk_ids)
                self.slot_pool.install_prefetch(layer_idx)
            out = self.copy.run(layer_idx, x, slot_ids, topk_weights, mode=mode, after_fork=after_fork)
            if la is not None:
                la.copy(layer_idx)          # the next layer's prefetch plan, behind this demand copy
            self.slot_pool.verify(layer_idx, topk_ids, slot_ids, after=True)
            return out
        self._count_on_device(topk_ids, self._dma_counts)      # the DMA path counts on the host; hits only here
        nxt = prefill_prefetch_layer(layer_idx, n, self.num_experts, self.num_layers, self.gather_max_pairs)
        if nxt is not None:
            prefetch_ensure(self.cache, nxt, self._candidates, self._candidates.numel(), check_ids=False)
        self.copy_missing(layer_idx, prefetch_layer=nxt)     # (its plan readback does not wait for `ready`;
        self.stats.calls += 1                                # its copies queue behind it on copy_stream)
        self._host_counts[2] += 1
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self.rows.ffn(mode, x, slot_ids, topk_weights, kernel_impl=self.kernel_impl)

    def set_policy(self, **fields) -> None:
        """The prefetch's SetPolicy fields (`prefetch`, `prefetch_budget`); the rest has nothing to set here."""
        self.slot_pool.prefetch_policy(fields)

    def set_prefetch(self, settings: PrefetchSettings, predictor: Predictor | None) -> None:
        """The lookahead prefetch (SlotPool.set_prefetch)."""
        self.slot_pool.set_prefetch(settings, predictor)

    def prefetch_counters(self) -> dict[str, int]:
        return self.slot_pool.prefetch_counters()

    def audit_slots(self, sample_slots: int = 0, probe_slots: int = 0, seed: int = 0) -> list[str]:
        return self.slot_pool.audit(sample_slots, probe_slots, seed)

    def reset_slots(self) -> None:
        self.slot_pool.reset()

    def side_streams(self) -> list:
        """The copy stream and the lookahead's predictor stream (CUDA)."""
        return self.slot_pool.side_streams()

    def graph_safe(self, num_pairs: int) -> bool:
        """Capturable in a CUDA graph: decode-sized calls (the device copy kernel and moe_gemv) on CUDA."""
        return (self.on_cuda and self.mode in ("auto", *GRAPH_SAFE_MODES) and self._decode_sized(num_pairs)
                and self.verifier is None)        # the verifier syncs

    def graph_key(self) -> tuple:
        """A captured decode step records the copy timer's current event set."""
        return ("offload", self.timer.graph_key(), self.lookahead.graph_key() if self.lookahead else ())

    def step_begin(self) -> None:
        self.timer.begin_step()
        self.slot_pool.step_begin()

    def step_end(self) -> bool:
        self.timer.end_step()
        self.slot_pool.step_end()
        return True

    def _count_on_device(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """The counters of a call, on the device (reads the plan `ensure` just wrote), into `counts`
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
        """Fold the device-side counters into `stats` (a device sync; `counts`: a `_counts.tolist()` the caller
        already read)."""
        counts = self._counts.tolist() if counts is None else counts
        fetched, misses, calls = (int(v) + h for v, h in zip(counts[0][:3], self._host_counts))
        self.stats.fetched, self.stats.distinct_misses, self.stats.calls = fetched, misses, calls
        self.stats.copy_bytes = fetched * self.layout.expert_nbytes
        return self.stats

    def counters(self) -> dict:
        """Cumulative counters under the engine's names (EngineStats, the /metrics expert figures), after each
        step: hits and misses (distinct experts of a layer call found in a slot, or not), experts fetched and
        their bytes, and the copies' time (`CopyTimer`). One small device read."""
        counts = self._counts.tolist()
        st = self.refresh_stats(counts)
        return {**self.prefetch_counters(), "expert_hits_total": int(counts[0][5] + counts[1][5]), "expert_misses_total": st.distinct_misses,
                "experts_fetched_total": st.fetched, "experts_prefetched_total": st.prefetched,
                "copy_bytes_total": st.copy_bytes,
                "copy_time_s_total": self.collect_copy_time(), "mode": "offload",
                "resets_after_error": st.resets_after_error}

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
        """The DMA path: execute the copy plan of the last `ensure` (host store -> slots); with `prefetch_layer`,
        then the plan of the `prefetch_ensure` made for that layer, behind it on the copy stream."""
        n, misses, dst, src, pdst, psrc = self._read_plan(prefetch=prefetch_layer is not None)
        st = self.stats
        st.distinct_misses += misses
        st.fetched += n + len(pdst)
        st.prefetched += len(pdst)
        st.copy_bytes += (n + len(pdst)) * self.layout.expert_nbytes
        self._host_counts[0] += n + len(pdst)
        self._host_counts[1] += misses
        if n == 0 and not pdst:
            return
        jobs = [(self.host.layers[layer_idx], dst, src)]                  # [E, N] host rows
        if pdst:
            jobs.append((self.host.layers[prefetch_layer], pdst, psrc))
        if not self.on_cuda:
            t0 = time.perf_counter()
            for host_layer, dsts, srcs in jobs:
                for d, s in zip(dsts, srcs):
                    self.slots[d].copy_(host_layer[s])
            self.timer.add_host(time.perf_counter() - t0)
            return
        compute = torch.cuda.current_stream(self.device)
        queued = torch.cuda.Event()
        queued.record(compute)                     # every GEMM already queued reads its slot first
        start, last = self.timer.loose_pair()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(queued)
            start.record(self.copy_stream)
            host_layer, dsts, srcs = jobs[0]
            for d, s in zip(dsts, srcs):
                self.slots[d].copy_(host_layer[s], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
            if pdst:
                host_layer, dsts, srcs = jobs[1]
                for d, s in zip(dsts, srcs):
                    self.slots[d].copy_(host_layer[s], non_blocking=True)
                self.slot_pool.prefetched[prefetch_layer] = last
            last.record(self.copy_stream)
        compute.wait_event(done)                   # this layer's experts; the prefetch runs on

    def collect_copy_time(self) -> float:
        """Seconds spent on copies so far, decode copies and the DMA path's (syncs on outstanding events)."""
        return self.timer.resolve()

    def expert_nbytes(self) -> int:
        return self.layout.expert_nbytes

    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def close(self) -> None:
        if self.owns_host:
            self.host.close()
        self.owns_host = False
