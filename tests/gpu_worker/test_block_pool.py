"""`BlockPool` and `chain_keys` (engine/block_pool.py) on their own: the three states of a block, the order blocks
are handed out and evicted in, ref counts, and keys that cover a block's whole prefix."""
from __future__ import annotations

import pytest

from ftexpert.gpu_worker.engine.block_pool import BlockPool, chain_keys


def keys_of(tokens, bs=2):
    return chain_keys([], tokens, bs)


def test_keys_chain_over_the_prefix():
    a = keys_of([1, 2, 3, 4, 5, 6])
    assert len(a) == 3 and len(set(a)) == 3 and all(len(k) == 16 for k in a)
    assert keys_of([1, 2, 3, 4]) == a[:2]                          # a prefix has the prefix's keys
    assert keys_of([9, 9, 3, 4])[1] != a[1]                       # same block tokens, another prefix
    assert keys_of([3, 4])[0] != a[1]                             # same tokens at another position
    grown = keys_of([1, 2])
    assert chain_keys(grown, [3, 4, 5, 6], 2) == a                # extended a block at a time
    with pytest.raises(ValueError, match="block 1 is not full"):
        chain_keys(keys_of([1, 2]), [3], 2)


def test_states_order_and_eviction():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_used == 2 and pool.num_available == 2
    k = keys_of([1, 2, 3, 4])
    assert pool.register(0, k[0]) and pool.register(1, k[1])
    assert not pool.register(1, k[0])                             # a key names one block only
    b = pool.allocate(1)
    assert pool.match(k) == [0, 1] and pool.match([keys_of([7, 7])[0], k[1]]) == []   # runs from the first key
    pool.acquire([0])                                             # shared: ref 2
    assert pool.ref[0] == 2 and pool.cost([0, 1]) == 0
    pool.release(reversed(a))                                     # 1 then 0 (still held by one)
    assert (pool.num_used, pool.num_cached, pool.num_free) == (2, 1, 1)
    pool.release([0])
    pool.release(b)                                               # unnamed: free again
    assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 2, 2) and pool.audit({}) == []
    assert pool.cost([0, 1]) == 2
    assert pool.allocate(2) == [2, 3]                             # free blocks before cached ones
    assert pool.allocate(1) == [1] and pool.evictions == 1        # then the one released longest ago
    assert pool.match(k) == [0] and pool.key_of[1] is None
    pool.acquire([0])                                             # a hit on a cached block: used again
    assert pool.num_cached == 0 and pool.ref[0] == 1
    assert pool.audit({0: 1, 1: 1, 2: 1, 3: 1}) == []
    assert pool.audit({0: 2, 1: 1, 2: 1, 3: 1}) == ["block 0: ref 1, 2 request table entries"]
    with pytest.raises(RuntimeError, match="5 KV blocks asked for, 0 available"):
        pool.allocate(5)
    pool.release([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="released with ref count 0"):
        pool.release([2])
    with pytest.raises(RuntimeError, match="free, not cached"):
        pool.acquire([2])
