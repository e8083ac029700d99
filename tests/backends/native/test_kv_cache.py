"""BlockPool: allocation order, reference counts, and the LRU block-level prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.backends.native.kv_cache import BlockPool, KVLayout, hash_block


def h(*tokens: int, parent: bytes | None = None) -> bytes:
    return hash_block(parent, np.array(tokens, dtype=np.int32))


def test_fifo_allocation_and_free_order() -> None:
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1] and pool.allocate(1) == [2]
    pool.free([2, 0])  # joins the tail in this order
    assert (pool.num_used, pool.num_free) == (1, 4)
    assert pool.allocate(4) == [3, 4, 2, 0]
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)


def test_reference_counts() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache(b, h(1, 2))
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.num_used == 1  # still referenced once
    pool.free([b])
    assert pool.num_used == 0
    with pytest.raises(RuntimeError, match="freed while not in use"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="cached while not in use"):
        pool.cache(1, h(3))


def test_hash_chains_parent() -> None:
    assert h(1, 2) == h(1, 2)
    assert h(3, 4, parent=h(1, 2)) != h(3, 4, parent=h(5, 6)) != h(3, 4)


def test_lookup_longest_leading_run_and_revival() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    ha = h(1, 2)
    hb = h(3, 4, parent=ha)
    hc = h(5, 6, parent=hb)
    for blk, hh in ((a, ha), (b, hb), (c, hc)):
        pool.cache(blk, hh)
    pool.free([c, b, a])  # free queue: 3 c b a
    assert pool.lookup([ha, hb, h(9, 9, parent=hb), hc]) == [a, b]  # stops at the first miss
    assert pool.num_evictable([a, b]) == 2
    pool.touch([a, b])  # revived: no longer free
    assert pool.num_free == 2 and pool.ref_count(a) == 1
    assert pool.allocate(2) == [3, c]  # taking c evicts it from the cache
    assert pool.lookup([ha, hb, hc]) == [a, b]
    assert pool.lookup([hc]) == [] and pool.num_cached == 2


def test_lru_eviction_order() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [h(i) for i in range(3)]
    for blk, hh in zip(blocks, hashes, strict=True):
        pool.cache(blk, hh)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    pool.touch(pool.lookup([hashes[1]]))  # reuse block 1: it leaves the free queue
    pool.free([blocks[1]])  # and returns as the most recently used
    assert pool.allocate(1) == [blocks[0]]  # least recently freed goes first
    assert pool.lookup([hashes[0]]) == [] and pool.lookup([hashes[1]]) == [blocks[1]]


def test_duplicate_content_keeps_both_blocks() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, h(7))
    pool.cache(b, h(7))
    pool.cache(b, h(7))  # registering twice is a no-op
    pool.free([a, b])
    assert pool.lookup([h(7)]) == [a]
    assert pool.allocate(1) == [a]  # evicts a; b still holds the content
    assert pool.lookup([h(7)]) == [b]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=60))
def test_matches_reference_model(ops: list[tuple[int, int]]) -> None:
    """Random allocate/free/cache/touch against a list-based reference of the same rules."""
    n = 6
    pool = BlockPool(n)
    ref = [0] * n
    free = list(range(n))  # head first
    cached: dict[int, bytes] = {}  # block -> hash
    for op, x in ops:
        if op == 0 and x <= len(free):  # allocate x
            got = pool.allocate(x)
            want, free = free[:x], free[x:]
            assert got == want
            for b in want:
                ref[b] = 1
                cached.pop(b, None)
        elif op == 1:  # free one reference of a used block
            used = [b for b in range(n) if ref[b]]
            if used:
                b = used[x % len(used)]
                pool.free([b])
                ref[b] -= 1
                if ref[b] == 0:
                    free.append(b)
        elif op == 2:  # register a used block under content x
            used = [b for b in range(n) if ref[b]]
            if used:
                b = used[x % len(used)]
                pool.cache(b, h(x))
                cached.setdefault(b, h(x))
        else:  # look up content x and take a reference to the hit
            holders = [b for b, hh in cached.items() if hh == h(x)]
            got = pool.lookup([h(x)])
            assert got == holders[:1]  # the oldest registered copy
            pool.touch(got)
            for b in got:
                if ref[b] == 0:
                    free.remove(b)
                ref[b] += 1
        assert pool.num_free == len(free) and pool.num_used == n - len(free)
        assert [pool.ref_count(b) for b in range(n)] == ref
        assert pool.num_cached == len(cached)


def test_kv_layout_from_budget() -> None:
    """The engine's derived KV geometry: whole blocks of the budget, at least two."""
    kv = KVLayout.from_budget(budget_bytes=10_000, block_size=16, bytes_per_token=64)
    assert (kv.num_blocks, kv.block_size) == (9, 16)  # 10000 // (16 * 64)
    with pytest.raises(ValueError, match="holds 1 blocks of 16 tokens"):
        KVLayout.from_budget(budget_bytes=2047, block_size=16, bytes_per_token=64)
