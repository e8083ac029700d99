"""Sequence sort and compact prefix tree against Python's sort and a naive dict trie."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.plan.prefix_tree import PrefixTree, build_prefix_tree
from batchjob.plan.seqsort import sort_sequences
from batchjob.tokenize.prompts import TokenizedPrompts


@st.composite
def prompt_lists(draw, max_prompts: int = 8, max_base: int = 12, max_tail: int = 4):
    """Token lists over a tiny vocabulary: branches of one base, duplicates, prefixes."""
    vocab = draw(st.integers(1, 3))
    base_len = draw(st.integers(0, max_base))
    base = np.random.default_rng(draw(st.integers(0, 2**16))).integers(0, vocab, base_len)
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(0, max_prompts))):
        kind = draw(st.sampled_from(["branch", "branch", "dup", "prefix"]))
        if kind == "dup" and seqs:
            seqs.append(list(draw(st.sampled_from(seqs))))
        elif kind == "prefix" and seqs:
            s = draw(st.sampled_from(seqs))
            seqs.append(s[: draw(st.integers(0, len(s)))])
        else:
            k = draw(st.integers(0, base_len))
            tail = draw(st.lists(st.integers(0, vocab - 1), max_size=max_tail))
            seqs.append([int(t) for t in base[:k]] + tail)
    return seqs


def lcp_of(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def tree_of(seqs: list[list[int]]) -> PrefixTree:
    p = TokenizedPrompts.from_lists(seqs)
    srt = sort_sequences(p.tokens, p.offsets)
    return build_prefix_tree(srt.order, p.lengths, srt.lcp)


def naive_compact_trie(seqs: list[list[int]]) -> tuple[dict[tuple, int], int]:
    """({node path: prompts under it}, number of trie nodes below the root)."""
    under: Counter[tuple] = Counter()
    ends: Counter[tuple] = Counter(tuple(s) for s in seqs)
    nxt: dict[tuple, set[int]] = {}
    for s in seqs:
        for k in range(len(s) + 1):
            under[tuple(s[:k])] += 1
            if k < len(s):
                nxt.setdefault(tuple(s[:k]), set()).add(s[k])
    under[()] = len(seqs)
    compact = {p: c for p, c in under.items() if p == () or ends[p] or len(nxt.get(p, ())) > 1}
    return compact, len(under) - 1


@settings(max_examples=150, deadline=None)
@given(prompt_lists(max_base=1200))
def test_sort_matches_python_sorted(seqs):
    p = TokenizedPrompts.from_lists(seqs)
    srt = sort_sequences(p.tokens, p.offsets)
    expected = sorted(range(len(seqs)), key=lambda i: seqs[i])  # stable: ties in input order
    assert srt.order.tolist() == expected
    pairs = pairwise(expected)
    assert srt.lcp.tolist() == [0] * bool(seqs) + [lcp_of(seqs[a], seqs[b]) for a, b in pairs]


def test_sort_long_rows_and_array_end():
    """Windows past the cap (linear steps) and rows ending at the very end of the array."""
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 50, 3000).tolist()
    seqs = [[*doc, 1], doc[:2999], [*doc, 0], [*doc[:1500], 7, 7], doc, doc[:2000]]
    seqs += [rng.integers(0, 2, 700).tolist() for _ in range(5)]
    p = TokenizedPrompts.from_lists(seqs)
    srt = sort_sequences(p.tokens, p.offsets)
    expected = sorted(range(len(seqs)), key=lambda i: seqs[i])
    assert srt.order.tolist() == expected
    assert srt.lcp[1:].tolist() == [lcp_of(seqs[a], seqs[b]) for a, b in pairwise(expected)]


@settings(max_examples=200, deadline=None)
@given(prompt_lists())
def test_tree_matches_naive_trie(seqs):
    tree = tree_of(seqs)
    got: dict[tuple, int] = {}
    for v in range(tree.num_nodes):
        slots = tree.order[tree.lo[v] : tree.hi[v]]
        path = tuple(seqs[slots[0]][: tree.depth[v]]) if len(slots) else ()
        assert all(tuple(seqs[s][: tree.depth[v]]) == path for s in slots)
        assert path not in got
        got[path] = int(tree.num_prompts[v])
    expected, trie_nodes = naive_compact_trie(seqs)
    assert got == expected
    assert tree.total_tokens == trie_nodes  # multi-level processed tokens
    assert [int(tree.depth[tree.end_node[i]]) for i in range(len(seqs))] == [len(s) for s in seqs]
    assert tree.num_ending.sum() == len(seqs)
    assert (tree.num_ending[tree.num_internal :] == 1).all()
    # structure: parents before children, CSR children agree with parent, levels
    ids = np.arange(1, tree.num_nodes)
    assert (tree.parent[1:] < ids).all() and tree.parent[0] == -1
    for v in range(tree.num_nodes):
        assert (tree.parent[tree.node_children(v)] == v).all()
    assert (tree.level[1:] == tree.level[tree.parent[1:]] + 1).all()
    assert (tree.tokens[1:] >= 1).all()


def test_tree_duplicates_and_prefixes():
    seqs = [[5, 6, 7], [5, 6], [5, 6, 7], [5, 6, 8, 9], [1]]
    tree = tree_of(seqs)
    by_path = {
        tuple(seqs[tree.order[tree.lo[v]]][: tree.depth[v]]): v for v in range(tree.num_nodes)
    }
    assert set(by_path) == {(), (1,), (5, 6), (5, 6, 7), (5, 6, 8, 9)}
    dup = by_path[(5, 6, 7)]
    assert dup < tree.num_internal and tree.num_ending[dup] == 2  # two identical prompts
    inner = by_path[(5, 6)]
    assert tree.num_ending[inner] == 1 and tree.num_prompts[inner] == 4  # prompt ends inside
    assert tree.tokens[inner] == 2 and tree.total_tokens == 6  # 1 | 5 6 | 7 | 8 9
