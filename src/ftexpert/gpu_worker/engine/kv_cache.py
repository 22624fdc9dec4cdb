"""`KVCache`: every running request's keys and values, in one pool of fixed-size blocks.

    k, v:          [L, NB, BS, Hkv, D]   L layers that keep K/V (cfg.num_kv_layers: all; qwen3_next: its
                                         full-attention ones), NB blocks of BS positions, Hkv kv heads, D head_dim
    block_tables:  [B, MB] int32, device B = max_running_requests rows (one per request slot), MB =
                                         ceil(max_context_tokens / BS) entries: the blocks of the slot's request in
                                         position order, -1 where none
    host_tables:   [B, MB] int32, host   the same, as the host last wrote it (`set_row`)

Token t of the request in slot s lives at [:, block_tables[s, t // BS], t % BS]. The engine's `KVBlocks`
(kv_blocks.py) hands blocks out and writes the rows; `sync` copies the rows written since the last sync to the
device in one copy queued on the stream, so a decode step queued earlier still reads the rows as they were. The
tables have fixed shapes and live outside any CUDA graph's pool: a captured decode step reads them as inputs that
change in place between replays.

Built without `num_blocks`, the cache has the fixed layout of a cache without an allocator (tests, benches, a
forward run by hand): one block of max_context_tokens positions per slot, slot s owning block s, so k[l, s, t] is
token t of slot s.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.checkpoint.config import MoeConfig

# Positions per KV block: the prefix cache shares whole blocks, so a smaller block shares more of a prefix; a larger
# one has fewer blocks to book and hash per token (a 32K prompt: 2,048 blocks of 16) and fewer page look-ups in the
# decode kernel (a 64-position tile spans 4 blocks of 16).
DEFAULT_KV_BLOCK_SIZE = 16


def pool_blocks(cfg: MoeConfig, dtype: torch.dtype, block_size: int, default_tokens: int,
                tokens: int | None = None, gib: float | None = None) -> int:
    """Blocks of the pool: `tokens` positions (rounded up to whole blocks), or as many as fit in `gib` GiB of K and
    V, else `default_tokens` positions (the engine's: max_running_requests x max_context_tokens, the memory a
    fixed row per request took)."""
    if gib is not None:
        n = int(gib * 2**30) // KVCache.nbytes_for(cfg, block_size, dtype)
        if n < 1:
            raise ValueError(f"kv_cache_gib={gib} holds not one KV block of {block_size} tokens "
                             f"({KVCache.nbytes_for(cfg, block_size, dtype)} bytes)")
        return n
    return -(-(tokens if tokens is not None else default_tokens) // block_size)


class KVCache:
    def __init__(self, cfg: MoeConfig, max_batch: int, max_context_tokens: int, dtype: torch.dtype,
                 device: torch.device, *, block_size: int | None = None, num_blocks: int | None = None):
        fixed = num_blocks is None
        if fixed:
            block_size, num_blocks = max_context_tokens, max_batch
        elif block_size is None or block_size < 1 or num_blocks < 1:
            raise ValueError(f"a paged KV cache needs block_size >= 1 and num_blocks >= 1, got {block_size}, "
                             f"{num_blocks}")
        self.num_layers, self.max_batch = cfg.num_kv_layers, max_batch
        self.max_context_tokens = max_context_tokens
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks_per_seq = -(-max_context_tokens // block_size)
        need = self.nbytes_for(cfg, num_blocks * block_size, dtype)
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            if need > free_bytes:
                raise RuntimeError(
                    f"the KV cache needs {need / 2**30:.2f} GiB ({num_blocks} blocks x {block_size} tokens) but "
                    f"{device} has {free_bytes / 2**30:.2f} GiB free; lower kv_cache_gib (or max_running_requests "
                    f"x max_context_tokens, its default)")
        shape = (cfg.num_kv_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled, not empty: positions the decode step reads but masks out must hold finite values.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.host_tables = torch.full((max_batch, self.max_blocks_per_seq), -1, dtype=torch.int32)
        if fixed:
            self.host_tables[:, 0] = torch.arange(max_batch, dtype=torch.int32)
        self.block_tables = self.host_tables.to(device, copy=True)     # a copy on the CPU too: sync writes it
        self._dirty: set[int] = set()                                  # rows written since the last sync

    @staticmethod
    def nbytes_for(cfg: MoeConfig, num_tokens: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for `num_tokens` positions."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_kv_layers * num_tokens * cfg.kv_size * elem

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer views with blocks and positions merged: k, v [NB*BS, Hkv, D] (index block*BS + offset)."""
        n = self.num_blocks * self.block_size
        return (self.k[layer].view(n, self.num_kv_heads, self.head_dim),
                self.v[layer].view(n, self.num_kv_heads, self.head_dim))

    def set_row(self, slot: int, blocks: list[int], start: int = 0) -> None:
        """Slot `slot`'s table row on the host from entry `start` on: `blocks` in position order, then -1 where
        start is 0 (a whole row; else the entries after them are left as they are: a request's new blocks). The
        device row follows at the next `sync`."""
        if start + len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"{start + len(blocks)} blocks exceed a row's {self.max_blocks_per_seq}")
        row = self.host_tables[slot]
        if start == 0:
            row.fill_(-1)
        if blocks:
            row[start:start + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self._dirty.add(slot)

    def row_blocks(self, slot: int, num_tokens: int) -> list[int]:
        """The blocks holding positions [0, num_tokens) of slot `slot` (host), checked to be there."""
        n = -(-num_tokens // self.block_size)
        if n > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} positions exceed max_context_tokens {self.max_context_tokens}")
        blocks = self.host_tables[slot, :n].tolist()
        if any(b < 0 for b in blocks):
            raise RuntimeError(f"slot {slot} has no KV block for some of positions [0, {num_tokens}): its row "
                               f"holds {blocks}")
        return blocks

    def sync(self) -> None:
        """Copy the host rows written since the last sync to the device: the rows and their indices in two copies
        queued on the current stream (from fresh pinned buffers on CUDA, so the host never waits for work queued
        before them) and one index_copy_ after them."""
        if not self._dirty:
            return
        slots = sorted(self._dirty)
        self._dirty.clear()
        index = torch.tensor(slots, dtype=torch.int64)
        rows = self.host_tables.index_select(0, index)
        if self.block_tables.device.type == "cuda":
            index, rows = index.pin_memory(), rows.pin_memory()
        device = self.block_tables.device
        self.block_tables.index_copy_(0, index.to(device, non_blocking=True), rows.to(device, non_blocking=True))
