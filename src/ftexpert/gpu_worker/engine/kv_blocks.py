"""`KVBlocks`: which KV blocks each running request holds, and the prefix cache over them.

The scheduler (scheduler.py) asks it three things:
- `admission(req)`: what admitting a waiting request would cost (the blocks for its prefill, less those a prefix
  hit shares) and `admit` to do it. A hit sets the request's `num_prefilled` past the shared blocks: its prefill
  starts there. A fresh prompt's last token is always computed (its logits are sampled), so at most
  (prompt - 1) // block_size blocks are shared; a preempted request, which samples nothing, may find all of its
  recompute in the cache and go straight to decoding (admitted with the blocks of its next decode step).
- `growth(req)` / `grow`: the blocks a decoding request needs before its next step: those holding positions
  [0, seq_len] (its next position, and the one after it for a decode step queued ahead), at most those of its
  longest possible sequence (`max_tokens`).
- `free(req)`: a finished, aborted or preempted request's blocks go back to the pool, full ones named in the
  prefix cache first (so the next turn of a conversation, or the preempted request itself, finds them).

`register_full(req)`, called before each plan, names the blocks a request filled since (prefill chunks, decode
steps). Prefix caching is off for models with linear-attention layers (Qwen3-Next): their recurrent and conv
states at a block boundary are not kept, and without them a hit could not resume the sequence (engine/README.md).
"""
from __future__ import annotations

from ftexpert.gpu_worker.engine.block_pool import BlockPool, chain_keys
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.engine.request import Request
from ftexpert.gpu_worker.engine.stats import EngineStats


class KVBlocks:
    def __init__(self, kv: KVCache, prefix_caching: bool, stats: EngineStats | None = None):
        self.kv, self.pool = kv, BlockPool(kv.num_blocks)
        self.block_size = kv.block_size
        self.prefix_caching = prefix_caching
        self.stats = stats if stats is not None else EngineStats()
        self.stats.kv_block_size = kv.block_size
        self.stats.prefix_cache_enabled = prefix_caching
        self.publish()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def max_tokens(num_prompt_tokens: int, max_new_tokens: int, max_context_tokens: int) -> int:
        """Positions a request may ever need: its prompt and every token it may generate but the last (never
        fed), and one more for a decode step queued ahead; at most the context."""
        return min(num_prompt_tokens + max_new_tokens, max_context_tokens)

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int, max_context_tokens: int) -> None:
        """ValueError for a request that could not run even alone in the pool."""
        tokens = self.max_tokens(num_prompt_tokens, max_new_tokens, max_context_tokens)
        need = self.blocks_for(tokens)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"the request needs up to {need} KV blocks of {self.block_size} tokens ({num_prompt_tokens} prompt "
                f"+ up to {tokens - num_prompt_tokens} generated tokens) but the KV cache holds "
                f"{self.pool.num_blocks} blocks ({self.pool.num_blocks * self.block_size} tokens) in all; shorten "
                f"the prompt, lower max_tokens, or give the KV cache more memory (kv_cache_gib)")

    # ---- admission ---------------------------------------------------------------------------
    def _keys(self, req: Request, num_blocks: int) -> list[bytes]:
        have, bs = len(req.block_keys), self.block_size
        if have < num_blocks:
            chain_keys(req.block_keys, req.sequence_ids(have * bs, (num_blocks - have) * bs), bs)
        return req.block_keys[:num_blocks]

    def _hits(self, req: Request) -> list[int]:
        if not self.prefix_caching:
            return []
        shareable = req.prefill_len if req.output_ids else req.prefill_len - 1
        return self.pool.match(self._keys(req, shareable // self.block_size))

    def _admitted_blocks(self, req: Request, hits: list[int]) -> int:
        """Blocks `req` holds once admitted with `hits`: those of its prefill, or, when the hits cover all of it (a
        preempted request's recompute found cached), those its first decode step needs (`growth`)."""
        if len(hits) * self.block_size < req.prefill_len:
            return self.blocks_for(req.prefill_len)
        limit = self.max_tokens(req.num_prompt_tokens, req.params.max_new_tokens, req.max_context_tokens)
        return self.blocks_for(min(req.seq_len + 1, limit))

    def admission(self, req: Request) -> tuple[list[int], int]:
        """(the cached blocks its sequence starts with, the available blocks admitting it takes up). No side
        effects on the pool."""
        hits = self._hits(req)
        return hits, self._admitted_blocks(req, hits) - len(hits) + self.pool.cost(hits)

    def admit(self, req: Request, slot: int, hits: list[int]) -> None:
        """Give `req` (just given `slot`) its blocks: `hits` shared, the rest new."""
        self.pool.acquire(hits)
        req.blocks = hits + self.pool.allocate(self._admitted_blocks(req, hits) - len(hits))
        req.num_registered = len(hits)
        req.num_prefilled = len(hits) * self.block_size
        self.kv.set_row(slot, req.blocks)
        if self.prefix_caching:
            self.stats.prefix_cache_queries_total += 1
            self.stats.prefix_cache_query_tokens_total += req.prefill_len
            self.stats.prefix_cache_hit_tokens_total += req.num_prefilled

    # ---- growth ------------------------------------------------------------------------------
    def growth(self, req: Request) -> int:
        """New blocks `req` needs before its next decode step (0 while it prefills)."""
        if req.in_prefill or req.finished:
            return 0
        limit = self.max_tokens(req.num_prompt_tokens, req.params.max_new_tokens, req.max_context_tokens)
        return max(0, self.blocks_for(min(req.seq_len + 1, limit)) - len(req.blocks))

    def grow(self, req: Request) -> None:
        n = self.growth(req)
        if n:
            start = len(req.blocks)
            req.blocks += self.pool.allocate(n)
            self.kv.set_row(req.slot, req.blocks[start:], start)

    # ---- the prefix cache and freeing --------------------------------------------------------
    def register_full(self, req: Request) -> None:
        """Name `req`'s blocks that are full of K/V and not yet named."""
        if not self.prefix_caching:
            return
        full = min(req.num_kv_tokens // self.block_size, len(req.blocks))
        if full <= req.num_registered:
            return
        keys = self._keys(req, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.blocks[i], keys[i])
        req.num_registered = full

    def free(self, req: Request) -> None:
        """Take `req`'s blocks back (the full ones stay cached) and clear its table row."""
        if not req.blocks:
            return
        self.register_full(req)
        self.pool.release(reversed(req.blocks))           # its last blocks are evicted first
        req.blocks = []
        req.num_registered = 0
        if req.slot is not None:
            self.kv.set_row(req.slot, [])

    def publish(self) -> None:
        """The pool's counts into the engine stats."""
        pool, s = self.pool, self.stats
        s.kv_blocks_total = pool.num_blocks
        s.kv_blocks_used, s.kv_blocks_cached, s.kv_blocks_free = pool.num_used, pool.num_cached, pool.num_free
        s.kv_cache_evictions_total = pool.evictions
