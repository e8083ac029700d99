"""Which requests of a vLLM batch share KV blocks, as groups for prefix-shared attention.

vLLM's prefix cache hands every request whose prompt starts like a cached one the same
physical blocks, so requests sharing a prefix have equal leading block ids in their block
table rows. ``shared_prefix_groups`` finds them from the block tables alone (no plan needed,
so vLLM's own prefix hits count too) and picks, for each request, at most one group whose
shared blocks lie wholly before its first query token, choosing the split that saves the most
KV reads: a group of g requests sharing k blocks is read once instead of g times.
``native_metadata`` turns that into the batch description the native CPU kernel takes
(``batchjob.kernels.meta.AttentionMetadata``), with the groups' requests made contiguous.
Pure numpy and torch: no vLLM import, tested against brute force.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchjob.kernels.meta import AttentionMetadata


@dataclass(frozen=True)
class PrefixGroup:
    members: np.ndarray  # int64 request indices (batch order)
    blocks: int  # leading blocks all members share


def context_blocks(table: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray, bs: int):
    """Per request: how many leading blocks lie wholly before its first query token (and
    hold real blocks: vLLM's null block, id 0, ends the run)."""
    full = (seq_lens - q_lens) // bs
    full = np.minimum(full, table.shape[1]).astype(np.int64)
    cols = np.arange(table.shape[1])
    null = (table == 0) & (cols[None, :] < full[:, None])
    first_null = np.where(null.any(axis=1), null.argmax(axis=1), full)
    return np.minimum(full, first_null)


# (saved block reads, groups chosen, members left to an ancestor's group)
_Best = tuple[int, list[PrefixGroup], list[np.ndarray]]


class _Node:
    """Requests sharing blocks [0, depth): their common blocks ``k`` and the child classes by
    block ``k`` (a request with no block there is a child of its own)."""

    def __init__(self, table: np.ndarray, ctx: np.ndarray, members: np.ndarray, depth: int):
        self.members = members
        lim = int(ctx[members].min())
        k = depth
        if len(members) > 1 and lim > depth:
            sub = table[members, depth:lim]
            same = (sub == sub[0]).all(axis=0)
            k = depth + (int(np.argmin(same)) if not same.all() else lim - depth)
        self.k = k
        self.children: list[_Node] = []
        if len(members) > 1:
            ends = members[ctx[members] <= k]
            deeper = members[ctx[members] > k]
            keys = table[deeper, k]
            order = np.argsort(keys, kind="stable")
            parts = np.split(deeper[order], np.flatnonzero(np.diff(keys[order])) + 1)
            for part in [*(np.sort(q) for q in parts if len(q)), *ends.reshape(-1, 1)]:
                self.children.append(_Node(table, ctx, part, k + 1 if len(part) > 1 else k))
        self._memo: dict[int, _Best] = {}

    def best(self, p: int) -> _Best:
        """(saved block reads, groups, members left to an ancestor's group of ``p`` blocks):
        each member left there saves ``p`` (the ancestor pays its ``p`` once)."""
        if p in self._memo:
            return self._memo[p]
        if not self.children:  # one request
            res: _Best = (p, [], [self.members])
        else:
            # (a) a group of this node's k blocks takes what the children leave
            kids = [c.best(self.k) for c in self.children]
            left = [m for _, _, ms in kids for m in ms]
            pool = np.sort(np.concatenate(left)) if left else self.members[:0]
            own = [PrefixGroup(pool, self.k)] if len(pool) > 1 else []
            a_val = sum(v for v, _, _ in kids) - self.k
            a: _Best = (a_val, [g for _, gs, _ in kids for g in gs] + own, [])
            # (b) no group here: the children leave members to the ancestor's
            up = [c.best(p) for c in self.children]
            b_val = sum(v for v, _, _ in up)
            b: _Best = (
                b_val,
                [g for _, gs, _ in up for g in gs],
                [m for _, _, ms in up for m in ms],
            )
            res = a if self.k > p and a_val > b_val else b
        self._memo[p] = res
        return res


def shared_prefix_groups(table: np.ndarray, ctx: np.ndarray) -> list[PrefixGroup]:
    """Disjoint groups of requests (>= 2 each) with their shared leading blocks, maximising
    the block reads saved, sum of (members - 1) x blocks: exact, by dynamic programming over
    the requests' block trie. ``table``: [R, M] block ids; ``ctx``: ``context_blocks``."""
    cand = np.flatnonzero(ctx > 0)
    if len(cand) < 2:
        return []
    _, groups, _ = _Node(table, ctx, cand, 0).best(0)
    return [g for g in groups if g.blocks > 0]


@dataclass(frozen=True)
class NativeBatch:
    meta: AttentionMetadata
    token_order: torch.Tensor | None  # int64 [T]: the kernel's token i is vLLM's token_order[i]


def native_metadata(
    table: np.ndarray, seq_lens: np.ndarray, query_start: np.ndarray, bs: int
) -> NativeBatch:
    """The native kernel's batch for a vLLM batch (``table`` [R, M] block ids, ``seq_lens``,
    ``query_start`` [R + 1] token offsets): each group's members contiguous, their own KV the
    blocks after the shared ones."""
    r = len(seq_lens)
    q_lens = np.diff(query_start).astype(np.int64)
    seq_lens = seq_lens.astype(np.int64)
    groups = shared_prefix_groups(table, context_blocks(table, seq_lens, q_lens, bs))
    shared = np.zeros(r, dtype=np.int64)  # leading blocks each request shares
    seq_group = np.full(r, -1, dtype=np.int32)
    width = max([grp.blocks for grp in groups], default=1)
    p_table = np.zeros((len(groups), width), dtype=np.int32)
    for g, grp in enumerate(groups):
        shared[grp.members] = grp.blocks
        seq_group[grp.members] = g
        p_table[g, : grp.blocks] = table[grp.members[0], : grp.blocks]
    # the groups' members first, group by group, then the rest in batch order
    order = np.concatenate([*(g.members for g in groups), np.flatnonzero(seq_group < 0)])
    order = order.astype(np.int64)
    q_len = q_lens[order]
    cu_q = np.concatenate([[0], np.cumsum(q_len)])
    # own KV: the blocks after the shared ones (a row shifted left by its shared count)
    m = table.shape[1]
    cols = np.minimum(shared[order][:, None] + np.arange(m)[None, :], m - 1)
    own_table = table[order[:, None], cols]
    first = np.concatenate([[0], np.cumsum([len(g.members) for g in groups], dtype=np.int64)])
    g_start, g_end = cu_q[first[:-1]], cu_q[first[1:]]  # each group's query tokens
    p_len = np.array([grp.blocks * bs for grp in groups], dtype=np.int64)
    kv_len = seq_lens[order] - shared[order] * bs
    starts = query_start[:-1].astype(np.int64)[order]
    identity = bool((order == np.arange(r)).all())
    token_order = None
    if not identity:  # kernel token i = vLLM token start[seq] + (i - cu_q[seq])
        shift = np.repeat(starts - cu_q[:-1], q_len)
        token_order = torch.from_numpy(shift + np.arange(int(cu_q[-1]), dtype=np.int64))

    def i32(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32))

    meta = AttentionMetadata(
        cu_q=i32(cu_q),
        kv_len=i32(kv_len),
        block_table=i32(own_table),
        slot_mapping=torch.zeros(0, dtype=torch.int64),  # vLLM writes the KV itself
        seq_group=i32(seq_group[order]),
        prefix_len=i32(p_len),
        prefix_block_table=i32(p_table),
        group_q_start=i32(g_start),
        group_q_end=i32(g_end),
        max_q_len=int(q_len.max()) if r else 0,
        max_kv_len=int(kv_len.max()) if r else 0,
        max_prefix_len=int(p_len.max()) if len(p_len) else 0,
    )
    return NativeBatch(meta, token_order)
