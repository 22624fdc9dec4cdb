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
steps). A model with linear-attention layers (Qwen3-Next) must also resume their recurrent and conv states where a
hit ends: with `checkpoints` (state_checkpoints.py) a hit is shortened to end where a state was kept, that state is
restored at admission, and a leaving request keeps its last boundary's state; without them its prefix caching is
off (engine/README.md).

All of that is the full-context group's (`KVCache.groups[0]`, `pool`); a cache with a window group (the
sliding-window layers) has its blocks kept by `window` (window_blocks.py): admitted only when it too has the blocks
(`Admission.window_cost`), moved along with each request in `grow`, named, freed and audited beside.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ftexpert.gpu_worker.engine.block_pool import BlockPool, chain_keys
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.engine.request import Request
from ftexpert.gpu_worker.engine.state_checkpoints import StateCheckpoints
from ftexpert.gpu_worker.engine.stats import EngineStats
from ftexpert.gpu_worker.engine.window_blocks import WindowBlocks


@dataclass
class Admission:
    """What admitting a waiting request takes: the full-context group's cached blocks its sequence starts with and
    the available blocks it uses up; the window group's likewise (none without one)."""
    hits: list[int]
    cost: int
    window_hits: list[int] = field(default_factory=list)
    window_cost: int = 0


class KVBlocks:
    def __init__(self, kv: KVCache, prefix_caching: bool, stats: EngineStats | None = None,
                 prefill_chunk_tokens: int | None = None, checkpoints: StateCheckpoints | None = None):
        """prefill_chunk_tokens: the scheduler's chunk (needed where the cache has a window group); checkpoints: the
        linear layers' kept states (a model with such layers, prefix caching on)."""
        self.kv, self.pool = kv, BlockPool(kv.num_blocks)
        self.checkpoints = checkpoints if prefix_caching else None
        if self.checkpoints is not None and kv.window_group is not None:
            # a hit is cut once for the kept states and once for the window's blocks: not both (no model has both)
            raise ValueError("a KV cache with a window group (sliding-window layers) and kept linear-layer states "
                             "(state checkpoints) in one model is not supported")
        self.block_size = kv.block_size
        self.prefix_caching = prefix_caching
        self.window: WindowBlocks | None = None
        if kv.window_group is not None:
            if prefill_chunk_tokens is None:
                raise ValueError("a KV cache with a window group needs prefill_chunk_tokens (its blocks per request)")
            self.window = WindowBlocks(kv.window_group, prefill_chunk_tokens, prefix_caching)
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
        keys = self._keys(req, shareable // self.block_size)
        hits = self.pool.match(keys)
        if self.checkpoints is not None:            # only as far as a kept state of the linear layers
            hits = hits[:self.checkpoints.usable_hits(keys, len(hits))]
        return hits

    def _admitted_blocks(self, req: Request, hits: list[int]) -> int:
        """Blocks `req` holds once admitted with `hits`: those of its prefill, or, when the hits cover all of it (a
        preempted request's recompute found cached), those its first decode step needs (`growth`)."""
        if len(hits) * self.block_size < req.prefill_len:
            return self.blocks_for(req.prefill_len)
        limit = self.max_tokens(req.num_prompt_tokens, req.params.max_new_tokens, req.max_context_tokens)
        return self.blocks_for(min(req.seq_len + 1, limit))

    def _limit(self, req: Request) -> int:
        return self.max_tokens(req.num_prompt_tokens, req.params.max_new_tokens, req.max_context_tokens)

    def admission(self, req: Request) -> Admission:
        """What admitting `req` takes (its prefix hits, shortened to those whose window blocks are cached too, and
        the available blocks of each group). No side effects on the pools."""
        hits = self._hits(req)
        adm = Admission(hits, 0)
        if self.window is not None:
            h, adm.window_hits = self.window.shorten(req.block_keys, len(hits))
            adm.hits = hits = hits[:h]
            adm.window_cost = self.window.cost(req, h * self.block_size, adm.window_hits, self._limit(req))
        adm.cost = self._admitted_blocks(req, hits) - len(hits) + self.pool.cost(hits)
        return adm

    def window_fits(self, adm: Admission) -> bool:
        """Whether the window group has the blocks `adm` takes (always, where there is none)."""
        return self.window is None or adm.window_cost <= self.window.pool.num_available

    def admit(self, req: Request, slot: int, adm: Admission) -> None:
        """Give `req` (just given `slot`) its blocks: the hits shared, the rest new."""
        hits = adm.hits
        self.pool.acquire(hits)
        req.blocks = hits + self.pool.allocate(self._admitted_blocks(req, hits) - len(hits))
        req.num_registered = len(hits)
        req.num_prefilled = len(hits) * self.block_size
        self.kv.set_row(slot, req.blocks)
        if self.checkpoints is not None:
            self.checkpoints.restore(slot, req.block_keys, len(hits))
        if self.window is not None:
            self.window.admit(req, slot, req.num_prefilled, adm.window_hits, self._limit(req))
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
        """Give `req` the blocks of its next step (`growth`; the window group: release those before its window, add
        those of its next chunk or decode step)."""
        n = self.growth(req)
        if n:
            start = len(req.blocks)
            req.blocks += self.pool.allocate(n)
            self.kv.set_row(req.slot, req.blocks[start:], start)
        if self.window is not None:
            self.window.advance(req, self._limit(req))

    def prefill(self, req: Request, num_tokens: int) -> None:
        """`req` runs a prefill chunk of `num_tokens` in this step: the window group's blocks it writes (the
        full-context group gave it its whole prefill's at admission)."""
        if self.window is not None:
            self.window.advance(req, self._limit(req), num_tokens)

    # ---- the prefix cache and freeing --------------------------------------------------------
    def register_full(self, req: Request) -> None:
        """Name `req`'s blocks that are full of K/V and not yet named (in each group)."""
        if not self.prefix_caching:
            return
        if self.window is not None:
            self.window.register(req, lambda n: self._keys(req, n))
        full = min(req.num_kv_tokens // self.block_size, len(req.blocks))
        if full <= req.num_registered:
            return
        keys = self._keys(req, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.blocks[i], keys[i])
        req.num_registered = full

    def free(self, req: Request) -> None:
        """Take `req`'s blocks back (the full ones stay cached) and clear its table rows."""
        if not req.blocks:
            return
        self.register_full(req)
        if self.checkpoints is not None and req.slot is not None:
            self.checkpoints.keep(req.slot, req.block_keys, req.num_registered)
        if self.window is not None:
            self.window.free(req)
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
        if self.checkpoints is not None:
            c = self.checkpoints
            s.state_checkpoints_cached = c.num_cached
            s.state_checkpoints_saved_total, s.state_checkpoint_restores_total = c.saved_total, c.restored_total
        if self.window is not None:
            w = self.window.pool
            s.kv_window_blocks_total = w.num_blocks
            s.kv_window_blocks_used, s.kv_window_blocks_cached, s.kv_window_blocks_free = (
                w.num_used, w.num_cached, w.num_free)
            s.kv_window_evictions_total = w.evictions
