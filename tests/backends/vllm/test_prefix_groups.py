"""Prefix groups found from vLLM block tables (backends/vllm/prefix_groups.py): the chosen
groups save as many KV block reads as the best of every partition (brute force), are valid,
and the native kernel's batch built from them attends exactly as dense attention does."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from batchjob.backends.native.attention.cpu import CpuAttention
from batchjob.backends.vllm.prefix_groups import (
    context_blocks,
    native_metadata,
    shared_prefix_groups,
)


def partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def common_blocks(table, ctx, members) -> int:
    lim = min(int(ctx[m]) for m in members)
    k = 0
    while k < lim and len({int(table[m, k]) for m in members}) == 1:
        k += 1
    return k


def brute_force(table, ctx) -> int:
    best = 0
    for part in partitions(list(range(len(ctx)))):
        best = max(best, sum((len(b) - 1) * common_blocks(table, ctx, b) for b in part))
    return best


def random_tables(rng: random.Random, n: int):
    """Requests drawn from a small trie of block paths, so prefixes are shared at several
    depths; each row's context (full blocks before its queries) cut at random."""
    paths: list[list[int]] = [[]]
    next_id = 1
    for _ in range(n + 3):
        base = rng.choice(paths)
        cut = rng.randint(0, len(base))
        new = base[:cut] + list(range(next_id, next_id + rng.randint(1, 4)))
        next_id += 4
        paths.append(new)
    rows = [[*rng.choice(paths[1:]), next_id + 10 * i] for i in range(n)]
    width = max(len(r) for r in rows)
    table = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)
    ctx = np.array([rng.randint(0, len(r)) for r in rows], dtype=np.int64)
    return table, ctx


@pytest.mark.parametrize("seed", range(60))
def test_groups_save_what_the_best_partition_saves(seed):
    rng = random.Random(seed)
    table, ctx = random_tables(rng, rng.randint(2, 7))
    groups = shared_prefix_groups(table, ctx)
    seen: set[int] = set()
    saved = 0
    for g in groups:
        members = g.members.tolist()
        assert len(members) >= 2 and not seen & set(members)
        seen |= set(members)
        assert 0 < g.blocks <= common_blocks(table, ctx, members)
        saved += (len(members) - 1) * g.blocks
    assert saved == brute_force(table, ctx)


def test_subtrees_that_group_all_their_requests_leave_nothing_above():
    # A, B share 1 2 3; C, D share 1 5 6: two groups of three blocks, none of one block
    table = np.array([[1, 2, 3, 9], [1, 2, 3, 10], [1, 5, 6, 11], [1, 5, 6, 12]])
    ctx = np.array([3, 3, 3, 3])
    groups = shared_prefix_groups(table, ctx)
    assert sorted((g.members.tolist(), g.blocks) for g in groups) == [([0, 1], 3), ([2, 3], 3)]
    assert brute_force(table, ctx) == 6


def test_null_blocks_and_query_positions_bound_the_shared_part():
    table = np.array([[5, 6, 7, 0], [5, 6, 0, 0], [5, 6, 7, 8]], dtype=np.int32)
    seq_lens = np.array([4 * 16, 4 * 16, 3 * 16 + 1])
    q_lens = np.array([1, 1, 20])
    ctx = context_blocks(table, seq_lens, q_lens, 16)
    # row 0: a null block at 3; row 1 at 2; row 2: its queries start inside block 1
    assert ctx.tolist() == [3, 2, 1]


@pytest.mark.parametrize("max_group_q", [None, 4])
@pytest.mark.parametrize("seed", range(8))
def test_native_batch_from_block_tables_equals_dense_attention(seed, max_group_q):
    """vLLM-style block tables (documents shared by whole blocks, rows in shuffled order,
    decodes and multi-token prefills mixed) -> native metadata -> the C kernel (or its torch
    fallback), against softmax(q k^T) v over each request's full sequence; with requests of
    more than ``max_group_q`` query tokens left out of the groups too."""
    rng = random.Random(seed)
    bs, hq, hkv, d = 16, 4, 2, 32
    nblocks = 200
    k_cache = torch.randn(nblocks, bs, hkv, d)
    v_cache = torch.randn(nblocks, bs, hkv, d)
    free = list(range(1, nblocks))
    rng.shuffle(free)
    docs = [[free.pop() for _ in range(rng.randint(1, 5))] for _ in range(3)]
    rows, seq_lens, q_lens = [], [], []
    for _ in range(rng.randint(3, 9)):
        doc = rng.choice(docs) if rng.random() < 0.8 else []
        own = rng.randint(1, 40)
        q = 1 if rng.random() < 0.6 else rng.randint(1, own)
        blocks = doc + [free.pop() for _ in range(-(-own // bs))]
        rows.append(blocks)
        seq_lens.append(len(doc) * bs + own)
        q_lens.append(q)
    width = max(len(r) for r in rows)
    table = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    t = int(starts[-1])
    q = torch.randn(t, hq, d)
    batch = native_metadata(table, np.array(seq_lens), starts, bs, max_group_q)
    if max_group_q is None:
        assert batch.meta.num_groups > 0 or len({tuple(r[:1]) for r in rows}) == len(rows)
    qk = q if batch.token_order is None else q[batch.token_order]
    out = CpuAttention(calibrate=False).attend(qk, k_cache, v_cache, batch.meta, d**-0.5)
    if batch.token_order is not None:
        out = torch.empty_like(out).index_copy_(0, batch.token_order, out)
    for r, (blocks, n, ql) in enumerate(zip(rows, seq_lens, q_lens, strict=True)):
        keys = k_cache[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1)
        vals = v_cache[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1)
        qs = q[starts[r] : starts[r + 1]]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * d**-0.5
        pos = torch.arange(n - ql, n)[:, None] >= torch.arange(n)[None, :]
        scores = scores.masked_fill(~pos, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        torch.testing.assert_close(out[starts[r] : starts[r + 1]], ref, atol=2e-5, rtol=1e-4)


def test_requests_with_many_query_tokens_join_no_group():
    """A long prefill attends its prefix in its own tiles (grouping it saves no KV reads a
    full tile does not, and costs a second partial and its merge); decodes and short
    prefills over the same document still share it."""
    bs = 16
    doc = [5, 6, 7]
    rows = [[*doc, 10 + i] for i in range(4)]
    table = np.array(rows, dtype=np.int32)
    q_lens = np.array([1, 1, 9, 3])  # the third: 9 query tokens
    seq_lens = np.full(4, 3 * bs + 12)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    everyone = native_metadata(table, seq_lens, starts, bs)
    assert everyone.meta.num_groups == 1
    assert (everyone.meta.seq_group.numpy() == 0).all()
    capped = native_metadata(table, seq_lens, starts, bs, max_group_q=8)
    assert capped.meta.num_groups == 1
    # kernel order: the group's three members, then the long prefill on its own
    assert capped.meta.seq_group.tolist() == [0, 0, 0, -1]
    assert capped.meta.kv_len.tolist() == [12, 12, 12, 3 * bs + 12]
    alone = native_metadata(table[2:3], seq_lens[2:3], np.array([0, 9]), bs, max_group_q=8)
    assert alone.meta.num_groups == 0


def test_partitions_helper_counts_bell_numbers():
    assert [sum(1 for _ in partitions(list(range(n)))) for n in range(1, 6)] == [1, 2, 5, 15, 52]
    assert list(itertools.islice(partitions([0]), 2)) == [[[0]]]
