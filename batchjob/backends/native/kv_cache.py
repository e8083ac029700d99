"""Paged KV block pool: allocation, reference counts, and an LRU block-level prefix cache.

Block ids ``0 .. num_blocks - 1`` index the runner's paged cache. A block is *used* while its
reference count is positive. Free blocks wait in one queue, in eviction order: ``allocate``
takes from the head, ``free`` appends to the tail (callers free a sequence's blocks last
block first, so that its most specific blocks are evicted first, as vLLM does).

Prefix cache (used by the baseline policy only): a full block can be registered under a
hash of its tokens chained with its parent block's hash. A cached block keeps its hash after
it is freed, so a later request with the same token prefix can take it back (``touch``)
until ``allocate`` hands it out again, which evicts it from the cache: freed cached blocks
are therefore evicted in LRU order. Several blocks may hold the same content (two requests
computed it at once); all are registered and a lookup returns the oldest, as in vLLM.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: np.ndarray) -> BlockHash:
    """Hash of one full block: its token ids chained with its parent block's hash."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return h.digest()


@dataclass(frozen=True)
class KVLayout:
    """The paged KV cache the scheduler allocates from: derived by the engine, not configured
    (``block_size`` is ``engine.block_size``; ``num_blocks`` is what the KV budget holds)."""

    num_blocks: int
    block_size: int

    @classmethod
    def from_budget(cls, budget_bytes: int, block_size: int, bytes_per_token: int) -> KVLayout:
        """As many blocks as ``budget_bytes`` holds; ValueError below two."""
        num_blocks = budget_bytes // (block_size * bytes_per_token)
        if num_blocks < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{block_size} tokens ({bytes_per_token} bytes/token): too small"
            )
        return cls(num_blocks, block_size)


class BlockPool:
    """Fixed set of KV blocks with reference counts and an optional prefix-cache index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}  # cached block -> its hash
        self._cached: dict[BlockHash, dict[int, None]] = {}  # hash -> its cached blocks

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out (free cached blocks included: they are evictable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (used or free)."""
        return len(self._hash_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (evicting their cache entries)."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} KV blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:
                same = self._cached[h]
                del same[block]
                if not same:
                    del self._cached[h]
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free queue's tail."""
        for block in blocks:
            ref = self._ref[block]
            if ref <= 0:
                raise RuntimeError(f"KV block {block} freed while not in use")
            self._ref[block] = ref - 1
            if ref == 1:
                self._free[block] = None

    # --- prefix cache -------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Cached blocks of the longest run of leading ``hashes`` found in the cache."""
        out = []
        for h in hashes:
            blocks = self._cached.get(h)
            if blocks is None:
                break
            out.append(next(iter(blocks)))
        return out

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are free (touching them removes them from the free queue)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each (cached) block, reviving free ones."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Register a full, used block under ``block_hash`` (no-op if it is registered)."""
        if self._ref[block] <= 0:
            raise RuntimeError(f"KV block {block} cached while not in use")
        if block in self._hash_of:
            return
        self._cached.setdefault(block_hash, {})[block] = None
        self._hash_of[block] = block_hash
