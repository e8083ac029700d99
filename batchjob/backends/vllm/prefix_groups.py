"""Which requests of a vLLM batch share KV blocks, as groups for prefix-shared attention.

vLLM's prefix cache hands every request whose prompt starts like a cached one the same
physical blocks, so requests sharing a prefix have equal leading block ids in their block
table rows. ``shared_prefix_groups`` finds them from the block tables alone (no plan needed,
so vLLM's own prefix hits count too) and picks, for each request, at most one group whose
shared blocks lie wholly before its first query token, choosing the split that saves the most
KV reads: a group of g requests sharing k blocks is read once instead of g times. The
caller may leave requests with many query tokens out (``native_metadata(max_group_q=)``).
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


# (saved block reads, groups chosen as (members, blocks), members left to an ancestor's group)
_Best = tuple[int, list[tuple[list[int], int]], list[int]]


class _Node:
    """Requests sharing their first ``k`` blocks and no more: an interval of the block trie's
    sorted rows. ``children``: deeper nodes, and request indices (leaves: a request whose
    blocks end at ``k`` or that no other request follows further)."""

    __slots__ = ("_memo", "children", "k")

    def __init__(self, k: int, child: _Node | int) -> None:
        self.k = k
        self.children: list[_Node | int] = [child]
        self._memo: dict[int, _Best] = {}

    def best(self, p: int) -> _Best:
        """(saved block reads, groups, members left to an ancestor's group of ``p`` blocks):
        each member left there saves ``p`` (the ancestor pays its ``p`` once)."""
        if p in self._memo:
            return self._memo[p]
        # (a) a group of this node's k blocks takes what the children leave
        a_val, a_groups, pool = -self.k, [], []
        for c in self.children:
            v, gs, left = c.best(self.k) if isinstance(c, _Node) else (self.k, [], [c])
            a_val += v
            a_groups += gs
            pool += left
        if len(pool) > 1:
            a_groups.append((pool, self.k))
        # (b) no group here: the children leave members to the ancestor's
        b_val, b_groups, b_left = 0, [], []
        for c in self.children:
            v, gs, left = c.best(p) if isinstance(c, _Node) else (p, [], [c])
            b_val += v
            b_groups += gs
            b_left += left
        res: _Best = (
            (a_val, a_groups, []) if self.k > p and a_val > b_val else (b_val, b_groups, b_left)
        )
        self._memo[p] = res
        return res


def _trie(table: np.ndarray, ctx: np.ndarray, cand: np.ndarray) -> _Node | int:
    """The block trie of the ``cand`` requests' first ``ctx`` blocks, compressed to the nodes
    where requests part: rows sorted, then the longest common prefixes of neighbours (an LCP
    interval tree, built in one pass)."""
    c = ctx[cand]
    m = int(c.max())
    # past a row's ctx: a value no other row has, so no prefix runs on there
    rows = np.where(np.arange(m)[None, :] < c[:, None], table[cand, :m].astype(np.int64),
                    -1 - np.arange(len(cand), dtype=np.int64)[:, None])  # fmt: skip
    order = np.lexsort(rows.T[::-1])
    rows = rows[order]
    eq = rows[1:] == rows[:-1]
    lcp = [*np.where(eq.all(axis=1), m, eq.argmin(axis=1)).tolist(), -1]  # -1: the end
    members = cand[order].tolist()
    stack: list[_Node] = []
    for i, req in enumerate(members):
        child: _Node | int = req
        while stack and stack[-1].k > lcp[i]:
            node = stack.pop()
            node.children.append(child)
            child = node
        if stack and stack[-1].k == lcp[i]:
            stack[-1].children.append(child)
        else:
            stack.append(_Node(lcp[i], child))
    return stack[0].children[0]


def shared_prefix_groups(table: np.ndarray, ctx: np.ndarray) -> list[PrefixGroup]:
    """Disjoint groups of requests (>= 2 each) with their shared leading blocks, maximising
    the block reads saved, sum of (members - 1) x blocks: exact, by dynamic programming over
    the requests' block trie. ``table``: [R, M] block ids; ``ctx``: ``context_blocks``."""
    cand = np.flatnonzero(ctx > 0)
    if len(cand) < 2:
        return []
    root = _trie(table, ctx, cand)
    if not isinstance(root, _Node):
        return []
    _, groups, _ = root.best(0)
    return [PrefixGroup(np.array(sorted(m), dtype=np.int64), k) for m, k in groups if k > 0]


@dataclass(frozen=True)
class NativeBatch:
    meta: AttentionMetadata
    token_order: torch.Tensor | None  # int64 [T]: the kernel's token i is vLLM's token_order[i]


def native_metadata(
    table: np.ndarray,
    seq_lens: np.ndarray,
    query_start: np.ndarray,
    bs: int,
    max_group_q: int | None = None,
) -> NativeBatch:
    """The native kernel's batch for a vLLM batch (``table`` [R, M] block ids, ``seq_lens``,
    ``query_start`` [R + 1] token offsets): each group's members contiguous, their own KV the
    blocks after the shared ones. ``max_group_q``: requests with more query tokens than this
    join no group (they attend their prefix in their own tiles)."""
    r = len(seq_lens)
    q_lens = np.diff(query_start).astype(np.int64)
    seq_lens = seq_lens.astype(np.int64)
    ctx = context_blocks(table, seq_lens, q_lens, bs)
    if max_group_q is not None:
        ctx = np.where(q_lens > max_group_q, 0, ctx)
    groups = shared_prefix_groups(table, ctx)
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


def block_tables(
    groups: int,
    members: int,
    prefix: int,
    own: int,
    qlen: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic vLLM step (benchmarks, the backend's attention measurement): ``groups`` x
    ``members`` requests, each group's ``prefix`` tokens in shared blocks, ``own`` tokens in
    blocks of its own, ``qlen`` query tokens each. Returns (blocks in the cache, block tables
    [R, M] int32 with the requests shuffled, sequence lengths [R], query start offsets
    [R + 1]), int32 tensors; block 0 stays unused, as vLLM's null block."""
    r = groups * members
    nb_p, nb_own = prefix // block_size, -(-own // block_size)
    nblocks = groups * nb_p + r * nb_own + 1
    ids = (torch.randperm(nblocks - 1, generator=generator) + 1).int()
    table = torch.zeros(r, nb_p + nb_own, dtype=torch.int32)
    nxt = groups * nb_p
    for i in range(r):
        k = i // members
        table[i, :nb_p] = ids[k * nb_p : (k + 1) * nb_p]
        table[i, nb_p:] = ids[nxt : nxt + nb_own]
        nxt += nb_own
    table = table[torch.randperm(r, generator=generator)].contiguous()
    seq = torch.full((r,), prefix + own, dtype=torch.int32)
    qsl = torch.arange(r + 1, dtype=torch.int32) * qlen
    return nblocks, table, seq, qsl
