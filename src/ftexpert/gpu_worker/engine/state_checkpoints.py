"""`StateCheckpoints`: the linear-attention layers' states at block boundaries, so that the prefix cache serves
models with such layers (Qwen3-Next) too.

A prefix hit skips the prefill of the blocks it shares; for a model whose linear layers carry a recurrent and a conv
state from token to token, the request must also start from the state those blocks leave behind. Keeping one at
every block boundary would cost, for qwen3-next-80b-a3b, 74 MiB a boundary (36 layers of a 32 x 128 x 128 fp32
recurrent state and a 48 KiB conv state) against 384 KiB of K/V for the block. Instead:

- each running request keeps its **two latest boundary checkpoints** (rows of `slot_conv` / `slot_recurrent`,
  two per state cache row): a copy of its states taken right after a forward that ends on a block boundary, a
  prefill chunk ending there (chunks are multiples of the block size, so every chunk but a prompt's last does) or a
  decode step writing a block's last position (every `block_size` decode tokens). The newer overwrites the older.
  Two, because a decode step queued ahead (overlap_decode) may complete a block whose token the request then never
  keeps (it stopped or was aborted meanwhile): the one before is still there;
- when the request leaves (finished, aborted or preempted), its newest checkpoint whose block is named in the
  prefix cache goes into the **store**, under the prefix key of the block it closes (the key covers every token up
  to the boundary). The store keeps `capacity` checkpoints, the least recently used evicted first.

A conversation's next turn resends its history, so it finds the checkpoint its last turn left: admission shortens
the K/V prefix hit to the longest run of cached blocks that ends at a kept state (`usable_hits`) and restores that
state into the request's row (`restore`); the tokens after it are prefilled as usual. A hit with no kept state behind
it is no hit: the request prefills from 0. Only a request's last boundary is kept, so two conversations that share a
system prompt do not share its state (each finds its own).

The copies are rows by Python index on the current stream, behind the forward that made them and before any queued
after; nothing here waits for the device, and the host keeps only which boundary each row holds.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ftexpert.gpu_worker.engine.state_cache import StateCache

ROWS_PER_REQUEST = 2      # the latest two boundaries: a step queued ahead may complete a block the request never keeps


class StateCheckpoints:
    def __init__(self, states: StateCache, capacity: int, block_size: int):
        if capacity < 1:
            raise ValueError(f"state checkpoint capacity={capacity} must be >= 1 (0: no prefix cache, not this store)")
        self.states, self.block_size = states, block_size
        conv, rec = states.conv, states.recurrent                    # [Llin, B, ...]
        B = states.max_batch
        need = self.nbytes_for(states, capacity)
        if conv.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(conv.device)
            if need > free_bytes:
                raise RuntimeError(
                    f"the linear layers' state checkpoints need {need / 2**30:.2f} GiB ({ROWS_PER_REQUEST} for each of "
                    f"{B} request rows and {capacity} kept for the prefix cache) but {conv.device} has "
                    f"{free_bytes / 2**30:.2f} GiB free; lower --state-checkpoints or max_running_requests, or turn "
                    f"the prefix cache off (--prefix-cache off)")
        rows = ROWS_PER_REQUEST * B                                  # request row s: checkpoint rows 2s, 2s + 1
        self.slot_conv = torch.zeros((conv.shape[0], rows) + tuple(conv.shape[2:]), dtype=conv.dtype,
                                     device=conv.device)
        self.slot_recurrent = torch.zeros((rec.shape[0], rows) + tuple(rec.shape[2:]), dtype=rec.dtype,
                                          device=rec.device)
        self.row_tokens = [0] * rows                                 # the boundary each checkpoint row holds (0: none)
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
        return per_row * (ROWS_PER_REQUEST * states.max_batch + capacity)

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    def _rows(self, slot: int) -> range:
        return range(ROWS_PER_REQUEST * slot, ROWS_PER_REQUEST * (slot + 1))

    def boundaries(self, slot: int) -> list[int]:
        """The boundaries (tokens) the request in `slot` holds checkpoints at, newest first (0: an empty row)."""
        return sorted((self.row_tokens[r] for r in self._rows(slot)), reverse=True)

    def _copy_in(self, row: int, conv: torch.Tensor, recurrent: torch.Tensor, boundary: int) -> None:
        self.slot_conv[:, row].copy_(conv)
        self.slot_recurrent[:, row].copy_(recurrent)
        self.row_tokens[row] = boundary

    # ---- a running request's boundary checkpoints -----------------------------------------------
    def mark(self, slots: list[int], boundaries: list[int]) -> None:
        """Rows `slots` just completed a block: their states (after `boundaries[i]` tokens, multiples of the block
        size) are copied over each one's older checkpoint row, behind the forward that made them."""
        for s, b in zip(slots, boundaries):
            if b <= 0 or b % self.block_size:
                raise ValueError(f"a state checkpoint at {b} tokens is not on a block boundary of {self.block_size}")
            row = min(self._rows(s), key=lambda r: self.row_tokens[r])          # the older (or empty) row
            self._copy_in(row, self.states.conv[:, s], self.states.recurrent[:, s], b)

    def keep(self, slot: int, keys: list[bytes], num_registered: int) -> bool:
        """The request in `slot` leaves: its newest checkpoint whose block is among its `num_registered` blocks named
        in the prefix cache (`keys`: their prefix keys) goes into the store under that block's key. Its rows are
        cleared. Whether one was kept."""
        rows = [r for r in self._rows(slot) if 0 < self.row_tokens[r] <= num_registered * self.block_size]
        row = max(rows, key=lambda r: self.row_tokens[r], default=None)
        b = 0 if row is None else self.row_tokens[row] // self.block_size
        for r in self._rows(slot):
            self.row_tokens[r] = 0
        if row is None:
            return False
        key = keys[b - 1]
        if key in self._entry:                            # the same prefix's state is there already
            self._entry.move_to_end(key)
            return False
        if not self._free:
            _, entry = self._entry.popitem(last=False)    # the least recently used
            self._free.append(entry)
        entry = self._free.pop()
        self.store_conv[entry].copy_(self.slot_conv[:, row])
        self.store_recurrent[entry].copy_(self.slot_recurrent[:, row])
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
        the first prefill chunk zeroes); that boundary becomes the row's checkpoint."""
        for r in self._rows(slot):
            self.row_tokens[r] = 0
        if num_hits == 0:
            return
        key = keys[num_hits - 1]
        entry = self._entry[key]
        self._entry.move_to_end(key)
        self.states.conv[:, slot].copy_(self.store_conv[entry])
        self.states.recurrent[:, slot].copy_(self.store_recurrent[entry])
        self._copy_in(self._rows(slot)[0], self.store_conv[entry], self.store_recurrent[entry],
                      num_hits * self.block_size)
        self.restored_total += 1
