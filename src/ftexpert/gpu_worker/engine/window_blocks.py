"""`WindowBlocks`: the blocks of the KV cache's window group (the sliding-window layers: kv_cache.py), per request.

A request holds the window group's blocks [first, end) of its positions (`Request.window_first`,
`Request.window_blocks`), its table row -1 elsewhere:
- first: the block of the first key its next query reads, `KVGroup.first_block(num_kv_tokens)` (the next query is at
  position num_kv_tokens: its next prefill chunk's first, or its next decode step's); the blocks before it no
  present or future query of the request reads, so each step (`advance`, before the plan) releases them;
- end: prefilling, those of the positions it has written, and for the one request whose chunk the plan runs, those
  that chunk writes too (`prefill`, `prefill_chunk_tokens` at most); decoding, the blocks of positions [0, seq_len]
  as in the full-context group (its next position and the one after it, for a step queued ahead).
So the request whose chunk runs holds at most `window_blocks_per_request(window, BS, chunk)` blocks (`bound`), every
other one at most `window_blocks_per_request(window, BS, 1)` (`decode_bound`), and the pool, sized for one of the
first and max_running_requests - 1 of the second (`kv_cache.pool_sizes`), never runs out: admission checks it
anyway and growth needs no preemption.

Prefix cache: the window group's full blocks are named under the same keys as the full-context group's (block i of
a sequence: its chain key), and one released, named, becomes cached rather than free. A hit on the full-context
group's first h blocks (a prefill that restarts at P = h * BS) also needs the window group's blocks of keys
[P - window + 1, P): `shorten` cuts the hit to the longest h whose window blocks are all still cached (h = 0 needs
none). Cached window blocks live in the pool's room that the running requests' bounds leave free.
"""
from __future__ import annotations

from typing import Callable

from ftexpert.gpu_worker.engine.block_pool import BlockPool
from ftexpert.gpu_worker.engine.kv_cache import KVGroup, window_blocks_per_request
from ftexpert.gpu_worker.engine.request import Request


class WindowBlocks:
    def __init__(self, group: KVGroup, prefill_chunk_tokens: int, prefix_caching: bool):
        if group.window is None:
            raise ValueError("WindowBlocks keeps a window group's blocks; this group keeps the whole context")
        self.group, self.pool = group, BlockPool(group.num_blocks)
        self.block_size, self.chunk = group.block_size, prefill_chunk_tokens
        self.prefix_caching = prefix_caching
        self.bound = window_blocks_per_request(group.window, group.block_size, prefill_chunk_tokens)
        self.decode_bound = window_blocks_per_request(group.window, group.block_size, 1)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def target(self, req: Request, num_kv_tokens: int, decode_limit: int, chunk: int = 0) -> tuple[int, int]:
        """[first, end): the blocks `req` needs before its next step when its K/V hold `num_kv_tokens` positions;
        decode_limit: the positions its longest sequence may need (KVBlocks.max_tokens); chunk: the positions of
        the prefill chunk it runs next (0: none in this step)."""
        first = self.group.first_block(num_kv_tokens)
        if num_kv_tokens < req.prefill_len:                                  # prefilling: the written ones, the chunk's
            end = self._blocks_for(min(num_kv_tokens + chunk, req.prefill_len))
        else:
            end = self._blocks_for(min(req.seq_len + 1, decode_limit))
        return first, max(first, end)

    # ---- admission -----------------------------------------------------------------------------
    def shorten(self, keys: list[bytes], hits: int) -> tuple[int, list[int]]:
        """(h <= hits, the window group's cached blocks of h's window): the longest prefix hit whose window blocks
        the pool holds."""
        if not self.prefix_caching:
            return 0, []
        h = hits
        while h > 0:
            first = self.group.first_block(h * self.block_size)
            blocks = [self.pool.by_key.get(keys[j]) for j in range(first, h)]
            missing = [j for j, b in zip(range(first, h), blocks) if b is None]
            if not missing:
                return h, blocks
            h = missing[-1]          # every hit past a missing block of its window needs that block too
        return 0, []

    def cost(self, req: Request, start: int, hits: list[int], decode_limit: int) -> int:
        """Available blocks admitting `req` takes when its prefill starts at `start` with `hits` shared."""
        first, end = self.target(req, start, decode_limit)
        return (end - first) - len(hits) + self.pool.cost(hits)

    def admit(self, req: Request, slot: int, start: int, hits: list[int], decode_limit: int) -> None:
        first, end = self.target(req, start, decode_limit)
        self.pool.acquire(hits)
        req.window_first = first
        req.window_blocks = hits + self._allocate(end - first - len(hits))
        req.window_registered = first + len(hits)
        self.group.set_row(slot, [])
        self.group.set_row(slot, req.window_blocks, first)

    # ---- each step -----------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[int]:
        if n > self.pool.num_available:     # the pool holds every running request's bound: never, unless misused
            raise RuntimeError(f"the KV cache's window group has {self.pool.num_available} blocks available, "
                               f"{n} needed; it holds {self.pool.num_blocks}, fewer than {self.bound} + "
                               f"(max_running_requests - 1) x {self.decode_bound}: build the cache with "
                               f"kv_cache.pool_sizes")
        return self.pool.allocate(n)

    def advance(self, req: Request, decode_limit: int, chunk: int = 0) -> None:
        """Release `req`'s blocks before its window and give it those of its next step (`chunk`: the positions of
        its prefill chunk in this step, 0: none). Before the plan, its full blocks named first (`register`)."""
        if req.finished or req.slot is None:
            return
        first, end = self.target(req, req.num_kv_tokens, decode_limit, chunk)
        drop = min(max(0, first - req.window_first), len(req.window_blocks))
        if drop:
            self.pool.release(req.window_blocks[:drop])                     # named ones stay cached
            del req.window_blocks[:drop]
            self.group.clear_entries(req.slot, req.window_first, req.window_first + drop)
            req.window_first += drop
        have = req.window_first + len(req.window_blocks)
        if not req.window_blocks:
            req.window_first = have = first
        if end > have:
            new = self._allocate(end - have)
            req.window_blocks += new
            self.group.set_row(req.slot, new, have)
        if len(req.window_blocks) > (self.bound if chunk else self.decode_bound):
            raise RuntimeError(f"request {req.request_id!r} holds {len(req.window_blocks)} window blocks, more "
                               f"than its bound {self.bound if chunk else self.decode_bound}")

    def register(self, req: Request, keys: Callable[[int], list[bytes]]) -> None:
        """Name `req`'s window blocks full of K/V (keys(n): its first n blocks' keys)."""
        if not self.prefix_caching or not req.window_blocks:
            return
        full = min(req.num_kv_tokens // self.block_size, req.window_first + len(req.window_blocks))
        start = max(req.window_registered, req.window_first)
        if full <= start:
            return
        chain = keys(full)
        for i in range(start, full):
            self.pool.register(req.window_blocks[i - req.window_first], chain[i])
        req.window_registered = full

    def free(self, req: Request) -> None:
        """Take `req`'s window blocks back, oldest first (its newest, which a hit on its whole sequence needs, are
        evicted last), and clear its row."""
        if req.window_blocks:
            self.pool.release(req.window_blocks)
        req.window_blocks, req.window_first, req.window_registered = [], 0, 0
        if req.slot is not None:
            self.group.set_row(req.slot, [])
