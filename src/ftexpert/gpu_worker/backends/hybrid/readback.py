"""`Readback`: what the host needs from the device after `ensure`, in one transfer and one sync.

The copy engines need host-issued copies (the plan), and the CPU pool needs the CPU-assigned triples
and the hidden states, so every layer reads back, into pinned host buffers, in one stream order:
    ints    = [num_copies, num_misses, num_distinct, dst[P], src[P], routes[R], ids[R]]   int32
              (+ [prefetch_copies, prefetch_dst[Q], prefetch_src[Q]] with prefetch: a prefill's next layer)
    weights = [R] fp32,  hidden = [T, H] in the channel's dtype
then synchronises the compute stream once (the layer's only host sync). P = the longest plan this
call can have (min(slots, experts, routes)), R = T*K routes (0 when the CPU gets nothing), Q = the longest
prefetch plan (min(slots, prefetch candidates)).
Legend: T tokens, K top-k, H hidden, E experts, S slots.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ftexpert.kernels.slot_cache import SlotCache


@dataclasses.dataclass
class LayerPlan:
    num_copies: int
    num_misses: int                  # distinct misses before any cap (ensure's num_missing_full)
    num_distinct: int                # distinct routed experts
    dst: list[int]                   # [num_copies] destination slots
    src: list[int]                   # [num_copies] layer-local expert rows
    routes: np.ndarray | None        # [T*K] int32: slot id, or -1 for the CPU
    ids: np.ndarray | None           # [T*K] int32: the router's expert ids
    weights: np.ndarray | None       # [T*K] fp32: the router's weights
    hidden: torch.Tensor | None      # [T, H] host copy of x (channel dtype)
    prefetch_dst: list[int] = dataclasses.field(default_factory=list)   # the prefetch plan (prefetch_ensure's)
    prefetch_src: list[int] = dataclasses.field(default_factory=list)   # rows of the prefetched layer


class Readback:
    """Grow-only host buffers (pinned on CUDA) for `read`; views into them stay valid until the next read."""

    def __init__(self, device: torch.device, hidden_dtype: torch.dtype):
        self.device, self.hidden_dtype = device, hidden_dtype
        self.on_cuda = device.type == "cuda"
        self._ints = self._alloc(0, torch.int32)
        self._weights = self._alloc(0, torch.float32)
        self._hidden = self._alloc(0, hidden_dtype)
        self._zero = torch.zeros(1, dtype=torch.int32, device=device)

    def _alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(max(numel, 1), dtype=dtype, pin_memory=self.on_cuda)

    def _room(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf if buf.numel() >= numel else self._alloc(max(numel, 2 * buf.numel()), buf.dtype)

    def read(self, cache: SlotCache, *, max_plan: int, ids: torch.Tensor | None = None,
             routes: torch.Tensor | None = None, weights: torch.Tensor | None = None,
             x: torch.Tensor | None = None, prefetch_candidates: int = 0) -> LayerPlan:
        """ids/routes [T, K] int32 (device), weights [T, K] fp32, x [T, H]: read back those given;
        prefetch_candidates > 0: also the plan of the `prefetch_ensure` made with that many candidates.

        Without routes, the distinct count of ids is computed on the device (nothing per route is read).
        """
        p = min(max_plan, cache.num_slots)
        r = routes.numel() if routes is not None else 0
        parts = [cache.num_indices, cache.num_missing_full]
        if ids is not None and routes is None:
            seen = torch.zeros(cache.num_experts, dtype=torch.int32, device=ids.device)     # [E], no sync
            parts.append(seen.index_fill_(0, ids.reshape(-1).long(), 1).sum(dtype=torch.int32).view(1))
        else:
            parts.append(self._zero)
        parts += [cache.evict_slots[:p], cache.src_indices[:p]]
        if routes is not None:
            parts += [routes.reshape(-1), ids.reshape(-1)]
        q = min(prefetch_candidates, cache.num_slots)
        if prefetch_candidates:
            parts += [cache.prefetch_num_indices, cache.prefetch_evict_slots[:q], cache.prefetch_src_indices[:q]]
        packed = torch.cat(parts)                                            # [3 + 2P + 2R (+ 1 + 2Q)] int32
        self._ints = self._room(self._ints, packed.numel())
        ints = self._ints[:packed.numel()]
        ints.copy_(packed, non_blocking=True)
        host_w = host_x = None
        if weights is not None:
            self._weights = self._room(self._weights, r)
            host_w = self._weights[:r]
            host_w.copy_(weights.reshape(-1), non_blocking=True)
        if x is not None:
            self._hidden = self._room(self._hidden, x.numel())
            host_x = self._hidden[:x.numel()].view(x.shape)
            host_x.copy_(x if x.dtype == self.hidden_dtype else x.to(self.hidden_dtype), non_blocking=True)
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()          # the layer's one host sync
        a = ints.numpy()
        n, misses = int(a[0]), int(a[1])
        if n > p:
            raise RuntimeError(f"the copy plan has {n} entries but only {p} were read back; pass a max_plan of at "
                               f"least the call's distinct experts")
        routes_h = a[3 + 2 * p:3 + 2 * p + r] if routes is not None else None
        ids_h = a[3 + 2 * p + r:3 + 2 * p + 2 * r] if routes is not None else None
        distinct = int(np.unique(ids_h).size) if ids_h is not None else int(a[2])
        plan = LayerPlan(n, misses, distinct, a[3:3 + n].tolist(), a[3 + p:3 + p + n].tolist(), routes_h, ids_h,
                         host_w.numpy() if host_w is not None else None, host_x)
        if prefetch_candidates:
            base = 3 + 2 * p + 2 * r
            m = int(a[base])
            if m > q:
                raise RuntimeError(f"the prefetch plan has {m} entries but only {q} were read back")
            plan.prefetch_dst = a[base + 1:base + 1 + m].tolist()
            plan.prefetch_src = a[base + 1 + q:base + 1 + q + m].tolist()
        return plan
