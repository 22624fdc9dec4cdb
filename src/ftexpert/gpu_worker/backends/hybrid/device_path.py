"""`DevicePath`: the hybrid backend's device hand-off. Decode-sized forwards on a CUDA GPU run with no host sync
at all, so that the engine captures the decode step in a CUDA graph.

Per layer: ensure with the device policy tensor; the copy plan as a kernel (kernels/expert_copy, on the side
stream in the gemv mode), beside it per pool member one `ring` kernel (its triples and the hidden states
written into its registered channel, request_seq rung), the GEMMs over slot ids, then one `join` kernel
per member (spin on done_seq, add the partial sums in place). Under fetch_round "split" one CPU expert a
layer is split by channels: the GPU fetches and computes channels [c, I) into the split slot
(kernels/expert_split), the worker the rest.

A failed share cannot be fetched inside the graph: the join leaves it out and raises a flag, later rings of
the step do nothing, and after the step the engine asks the backend's `step_end()`, whose `step_ok` here marks the
worker failed and has the step re-run as offload (a decode step is idempotent: the same K/V rows are rewritten).
Eager calls (graph warm-ups, no graphs) check the flag after the layer and redo it as offload at once. The device
path's counters are counted on the GPU (kernels.handoff.count_call, the joins' own) and folded into the backend's
stats between steps (`fold_counters`).
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from ftexpert.proto.cpu_channel import WorkerDead, WorkerTimeout
from ftexpert.gpu_worker.backends.offload.decode_copy import DecodeCopy
from ftexpert.gpu_worker.backends.offload.slot_pool import SlotPool
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout
from ftexpert.kernels import expert_split
from ftexpert.kernels import handoff as kernels_handoff
from ftexpert.kernels.expert_copy import copy_plan
from ftexpert.kernels.slot_cache import ensure

from ftexpert.gpu_worker.backends.hybrid.cpu_pool import CpuPool
from ftexpert.gpu_worker.backends.hybrid.doorbells import PoolDoorbells
from ftexpert.gpu_worker.backends.hybrid.slot_gemm import SlotGemm
from ftexpert.gpu_worker.backends.hybrid.split_policy import SplitPolicy
from ftexpert.gpu_worker.backends.hybrid.stats import HybridStats, StreamTimer

log = logging.getLogger("ft.hybrid")

# What the device path counts on the GPU (kernels.handoff.count_call, in its order), folded into stats between steps.
DEVICE_COUNTERS = ("experts_fetched_total", "expert_misses_total", "calls", "offload_calls_total", "routed_pairs",
                   "expert_hits_total")


class DevicePath:
    """The device hand-off of one hybrid backend (see the module docstring), over the backend's parts: its slot pool
    (the pool's last row, past the cache, is the split slot), the expert `layout`, the CPU `pool` and its `doorbells`,
    the GEMMs `gemm`, the `policy`, the `stats` and `timer` it counts into; `copy_stream` / `split_stream` (CUDA) the
    plan copy's and the split copy's streams, the plan copy in two parts (w13, then w2) unless `split_copy` is off.
    `on_failed_step` is called when a step's hand-off failed (after the workers were marked): the backend runs as
    offload for the re-run."""

    def __init__(self, slot_pool: SlotPool, layout: ExpertLayout, pool: CpuPool, doorbells: PoolDoorbells,
                 gemm: SlotGemm, policy: SplitPolicy, stats: HybridStats, timer: StreamTimer, *,
                 copy_stream: "torch.cuda.Stream | None", split_stream: "torch.cuda.Stream | None", split_copy: bool,
                 on_failed_step: Callable[[], None]):
        self.slot_pool, self.cache, self.slots = slot_pool, slot_pool.cache, slot_pool.slots
        self.layout, self.pool, self.doorbells, self.gemm, self.policy = layout, pool, doorbells, gemm, policy
        self.stats, self.timer, self.on_failed_step = stats, timer, on_failed_step
        self.device, self.on_cuda = slot_pool.device, slot_pool.on_cuda
        self.num_experts = self.cache.num_experts
        # the split slot: the GPU's channels of the expert split under fetch_round "split" (kernels/expert_split)
        self.split_slot = self.cache.total_slots
        self._split_desc = torch.tensor([-1, 0], dtype=torch.int32, device=self.device)   # expert, limit c
        self._split_counts = torch.zeros(expert_split.COUNTS_LEN, dtype=torch.int64, device=self.device)
        # the plan copy by the copy kernel on copy_stream beside the hits' GEMMs; the split expert's on split_stream
        self.decode_copy = DecodeCopy(self.slots, slot_pool.host_layers, self.cache, gemm.rows,
                                      stream=copy_stream, split=split_copy, extra_stream=split_stream)
        self._owner = torch.from_numpy(pool.split.owner.astype(np.int32)).flatten().to(self.device)   # [L * E]
        self._device_counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=self.device)

    @property
    def splits_experts(self) -> bool:
        """Whether decode steps split one expert a layer by channels (fetch_round "split", a bf16 expert of at least
        two whole SPLIT_UNITs: the split copy moves rows and columns of the weights, which a quantized expert's bytes
        do not lay out; nor a biased one's, whose down bias belongs to one side); elsewhere "split" rounds down
        only."""
        return (self.policy.policy.get("fetch_round") == "split" and self.policy.strategy == "hybrid"
                and not self.layout.quantized and not self.layout.act.bias
                and expert_split.splittable(self.layout.intermediate_size))

    def update_owner_map(self) -> None:
        """The pool's owner map re-read after set_shares (in place: captured graphs read this tensor)."""
        self._owner.copy_(torch.from_numpy(self.pool.split.owner.astype(np.int32)).flatten())

    def forward(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor,
                topk_weights: torch.Tensor, to_cpu: bool, ready: "torch.cuda.Event | None") -> torch.Tensor:
        """One layer: the compute stream first waits for `ready` (the experts a prefill prefetched for it, timed as a
        copy wait: the copy kernels may run on the compute stream), then `_layer`, then the lookahead's copy of the
        next layer's prefetch plan behind this demand copy."""
        if ready is not None:
            self.timer.wait_event(torch.cuda.current_stream(self.device), ready, "gpu_wait_for_copy_s_total")
        out = self._layer(layer_idx, x, ids, routes, topk_weights, to_cpu)
        if self.slot_pool.lookahead is not None:
            self.slot_pool.lookahead.copy(layer_idx)
        return out

    def _layer(self, layer_idx: int, x: torch.Tensor, ids: torch.Tensor, routes: torch.Tensor,
               topk_weights: torch.Tensor, to_cpu: bool) -> torch.Tensor:
        """One layer without a host sync (see the module docstring): ensure, the copy plan as a kernel
        with each member's ring beside it (gemv mode with the overlap; else the rings first), GEMMs over
        slot ids, join each member's partial sums into an fp32 total."""
        T, K = ids.shape
        c, p = self.cache, self.policy.policy
        if to_cpu:      # the device policy: a captured graph follows live changes (split: floor, then split_pick)
            ensure(c, layer_idx, routes, use_device_policy=True, check_ids=False)
        else:
            ensure(c, layer_idx, routes, fetch_fraction=1.0, round_mode=p["fetch_round"],
                   promote=bool(p["promote"]), check_ids=False)
        self.slot_pool.wait_prefetch(layer_idx)   # lookahead: this layer's prefetch joined (the next installed below)
        self.slot_pool.verify(layer_idx, ids, routes)
        max_copies = min(T * K, c.num_slots)
        split = to_cpu and self.splits_experts
        host_layer = self.slot_pool.host_layers[layer_idx]
        if split:                      # one CPU expert's channels [c, I) to the split slot (kernels/expert_split)
            expert_split.split_pick(routes, ids, c.num_missing_full, c.num_indices, c.policy, self._split_desc,
                                    self._split_counts, intermediate=self.layout.intermediate_size,
                                    split_slot=self.split_slot)

        def fetch_split_part(part: int) -> None:
            expert_split.split_copy(self.slots, host_layer, self._split_desc, split_slot=self.split_slot,
                                    hidden=self.layout.hidden_size, intermediate=self.layout.intermediate_size,
                                    part=part)

        def ring_and_count() -> None:  # the decode copy's after_fork: on the compute stream, beside the plan copy
            if to_cpu:
                weights = topk_weights.float().contiguous()
                for m in self.pool.members:
                    self.doorbells.for_member(m).ring(layer_idx, x, ids, routes, weights, owner=self._owner,
                                                      owner_offset=layer_idx * self.num_experts,
                                                      split=self._split_desc if split else None,
                                                      split_slot=self.split_slot)
            kernels_handoff.count_call(self._device_counts, ids, c.num_indices, c.num_missing_full,
                                       offload=not to_cpu)
            self.slot_pool.install_prefetch(layer_idx)     # lookahead: the next layer's, beside this copy
        mode = self.gemm.mode_for(routes.numel())
        if mode == "gemv":             # routes at -1 (the CPU's) add 0; the copy beside the hits' GEMMs
            out = self.decode_copy.run(layer_idx, x, routes, topk_weights, mode=mode, max_copies=max_copies,
                                       after_fork=ring_and_count, extra_copy=fetch_split_part if split else None,
                                       extra_slot=self.split_slot if split else -1)
        else:
            ring_and_count()
            copy_plan(self.slots, host_layer, c.evict_slots, c.src_indices, c.num_indices, max_copies=max_copies)
            if split:
                fetch_split_part(0)
                fetch_split_part(1)
            out = self.gemm.ffn_gpu_routes(x, routes, topk_weights, skip=False)
        if not to_cpu:
            return out
        # Sums in fp32 inside each join; the last one writes the model dtype (one rounding, as the host join).
        members = self.pool.members
        total = torch.empty(x.shape, dtype=torch.float32, device=self.device) if len(members) > 1 else None
        src = out
        for i, m in enumerate(members):
            dst = torch.empty_like(x) if i == len(members) - 1 else total
            self.doorbells.for_member(m).join(layer_idx, src, dst)
            src = dst
        if not (self.on_cuda and torch.cuda.is_current_stream_capturing()) and not self.step_ok():
            # Eager (a graph's warm-up, or no graphs): the failed share is known now; redo the layer as
            # offload (its hits and fetched experts are resident by now, the rest is fetched).
            return self._layer(layer_idx, x, ids, ids.clone(), topk_weights, to_cpu=False)
        return src

    def step_ok(self) -> bool:
        """The backend's step_end without disarming (also after each eager layer): sync, then the failure words.
        False when a share failed: its worker marked failed (a late one is killed), the flags cleared, the backend
        told (`on_failed_step`)."""
        if not self.doorbells.by_member:
            return True
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        failed = [(m, db) for m in self.pool.members
                  if (db := self.doorbells.by_member.get(m.index)) is not None and db.failure()]
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
        self.doorbells.reset_all()
        st.fallbacks_total += 1
        self.on_failed_step()               # the re-run fetches every miss, whatever re-admission would say
        return False

    def fold_counters(self) -> None:
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
            db = self.doorbells.by_member.get(m.index)
            if db is not None:
                d = db.take_counters()
                st.count_cpu(m.name, d["experts"], d["triples"], d["compute_ns"] / 1e9)
                wait_s = d["wait_ns"] / 1e9        # the joins run one after another: their waits add up
                st.cpu_workers[m.name].gpu_wait_s_total += wait_s
                st.gpu_wait_for_cpu_s_total += wait_s
                st.gpu_wait_for_cpu_unpaired_s_total += wait_s

    def close_doorbells(self) -> None:
        """Close the doorbells, keeping what they counted (their state tensors go with them)."""
        if not self.doorbells.by_member:
            return
        self.fold_counters()
        self.doorbells.close()
