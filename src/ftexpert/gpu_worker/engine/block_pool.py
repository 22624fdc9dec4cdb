"""`BlockPool`: the host's book of the KV cache's blocks, and the prefix keys that name cached ones.

Every block is in exactly one state:

| state | ref count | prefix key | what happens to it |
|---|---|---|---|
| used | >= 1 (one per request whose block table names it) | maybe | read (and, while not full, written) by its requests |
| cached | 0 | yes | reused by a request whose sequence starts with that prefix (`match`, `acquire`); evicted, least recently released first, when no free block is left |
| free | 0 | no | handed out by `allocate` (lowest id first) |

A block gets a key once its `block_size` positions all hold K/V (`register`); its contents never change after that
(a request writes only positions past its own shared prefix), so any number of requests may share it read-only.

The key of block i of a sequence is a 128-bit BLAKE2b digest chained over the key of block i - 1 (a fixed root for
block 0) and the block's token ids: it covers every token of the sequence up to the block's end, hence also the
block's position in the sequence. Nothing else goes in (no adapter, no sampling setting: K/V depend on the tokens
and their positions alone, for one model, which is all one engine serves). Two different prefixes share a key only
by a hash collision (about 2^-64 for 2^32 blocks).
"""
from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from typing import Iterable, Sequence

ROOT_KEY = b"ft-kv-prefix-root"


def chain_keys(keys: list[bytes], tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Extend `keys` (the keys of a sequence's first len(keys) blocks) in place by the keys of the blocks `tokens`
    fill (the sequence's tokens from block len(keys) on, whole blocks); returns `keys`. Each key is computed once
    per request and kept (Request.block_keys)."""
    for j in range(-(-len(tokens) // block_size)):
        chunk = tokens[j * block_size:(j + 1) * block_size]
        if len(chunk) != block_size:
            raise ValueError(f"block {len(keys)} is not full: {len(chunk)} of {block_size} tokens")
        h = hashlib.blake2b(keys[-1] if keys else ROOT_KEY, digest_size=16)
        h.update(struct.pack(f"<{block_size}q", *chunk))
        keys.append(h.digest())
    return keys


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}
        self._free = list(range(num_blocks))                       # a heap: lowest id first
        self._cached: OrderedDict[int, None] = OrderedDict()      # ref 0 with a key, least recently released first
        self.evictions = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out: free ones, then cached ones (evicted)."""
        return len(self._free) + len(self._cached)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    # ---- handing out and taking back ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` blocks, each with ref count 1: free ones first (lowest id first), then the least recently released
        cached ones, whose keys are dropped (an eviction)."""
        if n > self.num_available:
            raise RuntimeError(f"{n} KV blocks asked for, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._cached.popitem(last=False)
                del self.by_key[self.key_of[block]]
                self.key_of[block] = None
                self.evictions += 1
            self.ref[block] = 1
            out.append(block)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """One more reference to each of `blocks` (cached ones: back to used)."""
        for block in blocks:
            if self.ref[block] == 0:
                if block not in self._cached:
                    raise RuntimeError(f"block {block} is free, not cached: it holds no prefix to share")
                del self._cached[block]
            self.ref[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One reference less to each of `blocks`, in order: a block left without one becomes cached (it has a
        key; the blocks released last are evicted last) or free."""
        for block in blocks:
            if self.ref[block] < 1:
                raise RuntimeError(f"block {block} released with ref count {self.ref[block]}")
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.key_of[block] is not None:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._free, block)

    # ---- prefix keys -------------------------------------------------------------------------
    def register(self, block: int, key: bytes) -> bool:
        """Name a used, full block by its prefix key; False (and nothing changes) when another block holds that
        key already (two requests computed the same prefix at once: the second copy stays unnamed)."""
        if self.ref[block] < 1:
            raise RuntimeError(f"block {block} registered with ref count {self.ref[block]}")
        if key in self.by_key or self.key_of[block] is not None:
            return False
        self.by_key[key] = block
        self.key_of[block] = key
        return True

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of `keys`, from the first, that the pool holds (no side effects)."""
        out = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def cost(self, hits: Iterable[int]) -> int:
        """Available blocks that taking `hits` uses up (the cached ones among them)."""
        return sum(1 for b in hits if self.ref[b] == 0)

    # ---- checks ------------------------------------------------------------------------------
    def audit(self, held: dict[int, int] | None = None) -> list[str]:
        """What is inconsistent in the book (empty: nothing); `held`: block -> the references the requests'
        tables hold, which must equal the ref counts."""
        problems = []
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free) or free & cached:
            problems.append("a block is listed twice among the free and cached blocks")
        for b in range(self.num_blocks):
            state = (b in free) + (b in cached) + (self.ref[b] > 0)
            if state != 1 or self.ref[b] < 0:
                problems.append(f"block {b}: ref {self.ref[b]}, free {b in free}, cached {b in cached}")
            if b in cached and self.key_of[b] is None:
                problems.append(f"block {b} is cached without a key")
            if b in free and self.key_of[b] is not None:
                problems.append(f"block {b} is free with a key")
            if held is not None and held.get(b, 0) != self.ref[b]:
                problems.append(f"block {b}: ref {self.ref[b]}, {held.get(b, 0)} request table entries")
        for key, b in self.by_key.items():
            if self.key_of[b] != key:
                problems.append(f"key of block {b} does not map back to it")
        if sum(k is not None for k in self.key_of) != len(self.by_key):
            problems.append("keys and blocks differ in number")
        return problems
