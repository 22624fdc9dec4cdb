"""`StateCheckpoints`: the linear-attention layers' states at block boundaries, so that the prefix cache serves
models with such layers (Qwen3-Next) too.

A prefix hit skips the prefill of the blocks it shares; for a model whose linear layers carry a recurrent and a conv
state from token to token, the request must also start from the state those blocks leave behind. Keeping one at
every block boundary would cost, for qwen3-next-80b-a3b, 74 MiB a boundary (36 layers of a 32 x 128 x 128 fp32
recurrent state and a 48 KiB conv state) against 384 KiB of K/V for the block. Instead, each request keeps **one**:

- its **boundary checkpoint** (a row of `slot_conv` / `slot_recurrent`, beside its state cache row): a copy of its
  states taken after the forward that completes a block, in a prefill chunk ending on a boundary or in the decode
  step that writes a block's last position (every `block_size` tokens, one copy of the request's rows behind that
  step on the device, outside the CUDA graphs); a later boundary overwrites it;
- when the request leaves (finished, aborted or preempted), that checkpoint goes into the **store**, named by the
  prefix key of the block it closes (the key covers every token up to the boundary), if that block is named in
  the prefix cache. The store keeps `capacity` checkpoints, least recently used evicted first.

A conversation's next turn resends its history, so it finds the checkpoint its last turn left at the last boundary
that turn completed: admission shortens the K/V prefix hit to the longest run of cached blocks that ends at a
checkpoint (`usable_hits`) and restores that state into the request's row (`restore`); the tokens after it are
prefilled as usual. A hit with no checkpoint behind it is no hit: the request prefills from 0.

Everything happens in stream order on the device (copies of rows by index), so a decode step queued ahead
(overlap_decode) and its checkpoint copy stay in order; the host keeps only which boundary each row holds.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ftexpert.gpu_worker.engine.state_cache import StateCache


class StateCheckpoints:
    def __init__(self, states: StateCache, capacity: int, block_size: int):
        if capacity < 1:
            raise ValueError(f"state checkpoint capacity={capacity} must be >= 1 (0: no prefix cache, not this store)")
        self.states, self.capacity, self.block_size = states, capacity, block_size
        conv, rec = states.conv, states.recurrent                    # [Llin, B, ...]
        B = states.max_batch
        need = self.nbytes_for(states, capacity)
        if conv.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(conv.device)
            if need > free_bytes:
                raise RuntimeError(
                    f"the linear layers' state checkpoints need {need / 2**30:.2f} GiB ({B} request rows and "
                    f"{capacity} kept for the prefix cache) but {conv.device} has {free_bytes / 2**30:.2f} GiB free; "
                    f"lower max_running_requests or turn the prefix cache off (--prefix-cache off)")
        self.slot_conv, self.slot_recurrent = torch.zeros_like(conv), torch.zeros_like(rec)
        self.slot_tokens = [0] * B                                   # the boundary each row holds (0: none)
        self.store_conv = torch.zeros((capacity,) + tuple(conv.shape[:1] + conv.shape[2:]), dtype=conv.dtype,
                                      device=conv.device)            # [N, Llin, C, K-1]
        self.store_recurrent = torch.zeros((capacity,) + tuple(rec.shape[:1] + rec.shape[2:]), dtype=rec.dtype,
                                           device=rec.device)       # [N, Llin, Hv, Dk, Dv]
        self._entry: OrderedDict[bytes, int] = OrderedDict()        # prefix key -> store entry, least recent first
        self._free = list(range(capacity - 1, -1, -1))
        self.saved_total = 0               # checkpoints put in the store
        self.restored_total = 0            # admissions that resumed from one

    @staticmethod
    def nbytes_for(states: StateCache, capacity: int) -> int:
        """Bytes of the request rows' checkpoints and a store of `capacity`."""
        per_row = states.nbytes // states.max_batch
        return per_row * (states.max_batch + capacity)

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    # ---- a running request's boundary checkpoint ------------------------------------------------
    def mark(self, slots: list[int], boundaries: list[int]) -> None:
        """Rows `slots` just completed a block: their states (after `boundaries[i]` tokens, multiples of the block
        size) are copied to their checkpoint rows, behind the forward that made them."""
        if not slots:
            return
        for b in boundaries:
            if b <= 0 or b % self.block_size:
                raise ValueError(f"a state checkpoint at {b} tokens is not on a block boundary of {self.block_size}")
        idx = torch.tensor(slots, dtype=torch.int64, device=self.slot_conv.device)
        self.slot_conv.index_copy_(1, idx, self.states.conv.index_select(1, idx))
        self.slot_recurrent.index_copy_(1, idx, self.states.recurrent.index_select(1, idx))
        for s, b in zip(slots, boundaries):
            self.slot_tokens[s] = b

    def keep(self, slot: int, keys: list[bytes], num_registered: int) -> bool:
        """The request in `slot` leaves: its checkpoint goes into the store, named by the key of the block it closes,
        where that block is among its `num_registered` blocks named in the prefix cache (`keys`: their prefix keys).
        The row is cleared. Whether one was kept."""
        b, self.slot_tokens[slot] = self.slot_tokens[slot] // self.block_size, 0
        if b == 0 or b > num_registered:
            return False
        key = keys[b - 1]
        if key in self._entry:                            # the same prefix's state is there already
            self._entry.move_to_end(key)
            return False
        if not self._free:
            _, entry = self._entry.popitem(last=False)    # the least recently used
            self._free.append(entry)
        entry = self._free.pop()
        self.store_conv[entry].copy_(self.slot_conv[:, slot])
        self.store_recurrent[entry].copy_(self.slot_recurrent[:, slot])
        self._entry[key] = entry
        self.saved_total += 1
        return True

    # ---- admission ------------------------------------------------------------------------------
    def usable_hits(self, keys: list[bytes], num_hits: int) -> int:
        """Of a K/V hit on the first `num_hits` blocks (`keys`: the prompt's block keys), the longest run that ends
        at a kept state (0: none)."""
        for h in range(num_hits, 0, -1):
            if keys[h - 1] in self._entry:
                return h
        return 0

    def restore(self, slot: int, keys: list[bytes], num_hits: int) -> None:
        """Start row `slot` from the state kept after block `num_hits` (`usable_hits` gave it; 0: a fresh row, which
        the first prefill chunk zeroes); the row's checkpoint is that boundary."""
        if num_hits == 0:
            self.slot_tokens[slot] = 0
            return
        entry = self._entry[keys[num_hits - 1]]
        self._entry.move_to_end(keys[num_hits - 1])
        self.states.conv[:, slot].copy_(self.store_conv[entry])
        self.states.recurrent[:, slot].copy_(self.store_recurrent[entry])
        self.slot_conv[:, slot].copy_(self.store_conv[entry])
        self.slot_recurrent[:, slot].copy_(self.store_recurrent[entry])
        self.slot_tokens[slot] = num_hits * self.block_size
        self.restored_total += 1
