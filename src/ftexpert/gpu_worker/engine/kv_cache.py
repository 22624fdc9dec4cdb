"""`KVCache`: every running request's keys and values, in pools of fixed-size blocks, one pool per layer group.

A layer group (`KVGroup`) is a set of KV layers that keep the same positions: the full-attention layers keep the
whole context; the sliding-window layers of a model that has both (gpt-oss: `sliding_attention` layers, window 128)
form a window group that keeps only the blocks a present or future query can still read. Every other model (and a
cache built without `window_num_blocks`) has one group: every layer keeps the whole context, as it always did.

Per group:
    k, v:          [Lg, NB, BS, Hkv, D]  Lg of the cfg.num_kv_layers KV layers (all; qwen3_next: its
                                         full-attention ones), NB blocks of BS positions, Hkv kv heads, D head_dim
    block_tables:  [B, MB] int32, device B = max_running_requests rows (one per request slot), MB =
                                         ceil(max_context_tokens / BS) entries: the blocks of the slot's request in
                                         position order, -1 where none (a window group: -1 also before its window)
    host_tables:   [B, MB] int32, host   the same, as the host last wrote it (`set_row`)

Token t of the request in slot s lives at [local layer, block_tables[s, t // BS], t % BS] of its layer's group.
`KVCache.k`, `.v`, `.block_tables`, `.host_tables`, `.num_blocks`, `set_row` and `row_blocks` are those of the
first group (the full-attention one; the only one of a one-group cache). The engine's `KVBlocks` (kv_blocks.py) hands
blocks out and writes the rows; `sync` copies the rows written since the last sync to the device in one copy per
group queued on the stream, so a decode step queued earlier still reads the rows as they were. The tables have fixed
shapes and live outside any CUDA graph's pool: a captured decode step reads them as inputs that change in place.

Built without `num_blocks`, the cache has the fixed layout of a cache without an allocator (tests, benches, a
forward run by hand): one group, one block of max_context_tokens positions per slot, slot s owning block s, so
k[l, s, t] is token t of slot s.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import gpt_oss_params

# Positions per KV block: the prefix cache shares whole blocks, so a smaller block shares more of a prefix; a larger
# one has fewer blocks to book and hash per token (a 32K prompt: 2,048 blocks of 16) and fewer page look-ups in the
# decode kernel (a 64-position tile spans 4 blocks of 16).
DEFAULT_KV_BLOCK_SIZE = 16


def kv_layer_windows(cfg: MoeConfig) -> list[int | None]:
    """Each KV layer's attention window (None: the whole context). gpt-oss: its per-layer windows; every other
    architecture None (MoeConfig.sliding_window, a window of every layer, keeps the whole context: one group)."""
    if cfg.arch == "gptoss":
        params = gpt_oss_params(cfg)
        return [params.layer_window(i) for i in range(cfg.num_kv_layers)]
    return [None] * cfg.num_kv_layers


def window_split(cfg: MoeConfig) -> tuple[list[int], list[int], int | None]:
    """(full-context layers, window layers, the window): the layers of a window group where the model has
    full-attention layers and sliding layers of one window; else every layer full and no window."""
    windows = kv_layer_windows(cfg)
    full = [i for i, w in enumerate(windows) if w is None]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not full or not sliding or len({windows[i] for i in sliding}) != 1:
        return list(range(len(windows))), [], None
    return full, sliding, windows[sliding[0]]


def window_blocks_per_request(window: int, block_size: int, chunk_tokens: int) -> int:
    """The most window-group blocks a request holds: a prefill chunk of C positions at p reads keys from
    p - window + 1 to p + C - 1 (window + C - 1 positions); a decode step at p with one queued ahead, p - window + 1
    to p + 1 (window + 1). L consecutive positions touch at most ceil((L - 1) / BS) + 1 blocks."""
    span = window + max(chunk_tokens, 2) - 1
    return -(-(span - 1) // block_size) + 1


def block_nbytes(cfg: MoeConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one block of `num_layers` layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * cfg.kv_size * elem


def pool_sizes(cfg: MoeConfig, dtype: torch.dtype, block_size: int, max_running: int, max_context: int,
               chunk_tokens: int, tokens: int | None = None, gib: float | None = None) -> tuple[int, int]:
    """(full-context group blocks, window group blocks; 0: no window group). The window group holds the bound of the
    one request whose prefill chunk runs (`window_blocks_per_request` at chunk_tokens) and max_running - 1 decoding
    ones' (at a chunk of 1): every running request its bound, so it never runs out (window_blocks.py). The full
    group: `tokens` positions (rounded up to whole blocks), or what `gib` GiB hold once the window group's share is
    taken, else max_running x max_context positions (the memory a fixed row per request took)."""
    full, sliding, window = window_split(cfg)
    win_blocks = (window_blocks_per_request(window, block_size, chunk_tokens)
                  + (max_running - 1) * window_blocks_per_request(window, block_size, 1)) if sliding else 0
    if gib is not None:
        win_bytes = win_blocks * block_nbytes(cfg, len(sliding), block_size, dtype)
        per_block = block_nbytes(cfg, len(full), block_size, dtype)
        n = (int(gib * 2**30) - win_bytes) // per_block
        if n < 1:
            extra = (f" once the sliding-window layers' {win_bytes} bytes ({win_blocks} blocks for "
                     f"max_running_requests={max_running} windows and one prefill chunk) are taken" if sliding else "")
            raise ValueError(f"kv_cache_gib={gib} holds not one KV block of {block_size} tokens ({per_block} "
                             f"bytes){extra}; raise kv_cache_gib")
        return n, win_blocks
    return -(-(tokens if tokens is not None else max_running * max_context) // block_size), win_blocks


class KVGroup:
    """The K/V of the KV layers `layers` (the cfg's KV layer indices, in order), which keep the positions of
    `window` (None: the whole context), in one pool of `num_blocks` blocks with one table row per slot."""

    def __init__(self, layers: list[int], window: int | None, cfg: MoeConfig, max_batch: int,
                 max_context_tokens: int, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers, self.window = tuple(layers), window
        self.max_context_tokens = max_context_tokens
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks_per_seq = -(-max_context_tokens // block_size)
        shape = (len(layers), num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled, not empty: positions the decode step reads but masks out must hold finite values.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.host_tables = torch.full((max_batch, self.max_blocks_per_seq), -1, dtype=torch.int32)
        self.block_tables = self.host_tables.to(device, copy=True)     # a copy on the CPU too: sync writes it
        self._dirty: set[int] = set()                                  # rows written since the last sync

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def first_block(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads: 0 without a window."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.block_size

    def flat(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer views with blocks and positions merged: k, v [NB*BS, Hkv, D] (index block*BS + offset)."""
        n = self.num_blocks * self.block_size
        return (self.k[local].view(n, self.num_kv_heads, self.head_dim),
                self.v[local].view(n, self.num_kv_heads, self.head_dim))

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

    def clear_entries(self, slot: int, start: int, end: int) -> None:
        """Entries [start, end) of slot `slot`'s row to -1 (blocks that left a window)."""
        if end > start:
            self.host_tables[slot, start:end] = -1
            self._dirty.add(slot)

    def row_blocks(self, slot: int, num_tokens: int, first: int = 0) -> list[int]:
        """The blocks holding positions [first * BS, num_tokens) of slot `slot` (host), checked to be there."""
        n = -(-num_tokens // self.block_size)
        if n > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} positions exceed max_context_tokens {self.max_context_tokens}")
        blocks = self.host_tables[slot, first:n].tolist()
        if any(b < 0 for b in blocks):
            raise RuntimeError(f"slot {slot} has no KV block for some of positions [{first * self.block_size}, "
                               f"{num_tokens}): its row holds {blocks} from entry {first}")
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


class KVCache:
    def __init__(self, cfg: MoeConfig, max_batch: int, max_context_tokens: int, dtype: torch.dtype,
                 device: torch.device, *, block_size: int | None = None, num_blocks: int | None = None,
                 window_num_blocks: int | None = None):
        """`num_blocks`: the full-context group's pool (None: the fixed layout); `window_num_blocks`: the window
        group's, for a model with sliding layers (`window_split`; None: every layer keeps the whole context)."""
        fixed = num_blocks is None
        if fixed:
            block_size, num_blocks, window_num_blocks = max_context_tokens, max_batch, None
        elif block_size is None or block_size < 1 or num_blocks < 1:
            raise ValueError(f"a paged KV cache needs block_size >= 1 and num_blocks >= 1, got {block_size}, "
                             f"{num_blocks}")
        full, sliding, window = window_split(cfg) if window_num_blocks is not None else (
            list(range(cfg.num_kv_layers)), [], None)
        if window_num_blocks is not None and window_num_blocks < 1 and sliding:
            raise ValueError(f"window_num_blocks={window_num_blocks} must be >= 1")
        self.num_layers, self.max_batch = cfg.num_kv_layers, max_batch
        self.max_context_tokens = max_context_tokens
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.block_size = block_size
        need = (num_blocks * block_nbytes(cfg, len(full), block_size, dtype)
                + (window_num_blocks * block_nbytes(cfg, len(sliding), block_size, dtype) if sliding else 0))
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            if need > free_bytes:
                raise RuntimeError(
                    f"the KV cache needs {need / 2**30:.2f} GiB ({num_blocks} blocks x {block_size} tokens"
                    f"{f', and {window_num_blocks} blocks of its sliding-window layers' if sliding else ''}) but "
                    f"{device} has {free_bytes / 2**30:.2f} GiB free; lower kv_cache_gib (or max_running_requests "
                    f"x max_context_tokens, its default)")
        self.groups = [KVGroup(full, None, cfg, max_batch, max_context_tokens, block_size, num_blocks, dtype,
                               device)]
        if sliding:
            self.groups.append(KVGroup(sliding, window, cfg, max_batch, max_context_tokens, block_size,
                                       window_num_blocks, dtype, device))
        self._layer = [(0, 0)] * cfg.num_kv_layers                    # KV layer -> (group, its index there)
        for g, group in enumerate(self.groups):
            for local, layer in enumerate(group.layers):
                self._layer[layer] = (g, local)
        main = self.groups[0]
        if fixed:
            main.host_tables[:, 0] = torch.arange(max_batch, dtype=torch.int32)
            main.block_tables.copy_(main.host_tables)
        self.num_blocks, self.max_blocks_per_seq = main.num_blocks, main.max_blocks_per_seq
        self.k, self.v = main.k, main.v
        self.host_tables, self.block_tables = main.host_tables, main.block_tables

    @staticmethod
    def nbytes_for(cfg: MoeConfig, num_tokens: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of every KV layer for `num_tokens` positions."""
        return block_nbytes(cfg, cfg.num_kv_layers, num_tokens, dtype)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def window_group(self) -> KVGroup | None:
        """The sliding-window layers' group, where there is one."""
        return self.groups[1] if len(self.groups) > 1 else None

    def layer_group(self, layer: int) -> tuple[KVGroup, int]:
        """(the group of KV layer `layer`, the layer's index in it)."""
        g, local = self._layer[layer]
        return self.groups[g], local

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV layer `layer`'s views with blocks and positions merged: k, v [NB*BS, Hkv, D] of its group's pool."""
        group, local = self.layer_group(layer)
        return group.flat(local)

    def set_row(self, slot: int, blocks: list[int], start: int = 0) -> None:
        """The first group's row (see `KVGroup.set_row`)."""
        self.groups[0].set_row(slot, blocks, start)

    def row_blocks(self, slot: int, num_tokens: int) -> list[int]:
        """The blocks holding positions [0, num_tokens) of slot `slot` in the first group (host), checked."""
        return self.groups[0].row_blocks(slot, num_tokens)

    def sync(self) -> None:
        """Every group's rows written since the last sync, to the device (`KVGroup.sync`)."""
        for group in self.groups:
            group.sync()
