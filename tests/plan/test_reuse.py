"""First-level reuse: Algorithm 1 as written, the exact DP, and a brute-force optimum."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from batchjob.plan.build import planning_tree
from batchjob.plan.prefix_tree import PrefixTree
from batchjob.plan.reuse import Grouping, first_level_groups, optimal_groups, paper_groups
from batchjob.plan.seqsort import sort_sequences
from batchjob.tokenize.prompts import TokenizedPrompts
from tests.plan.test_prefix_tree import prompt_lists


def plan_tree(seqs: list[list[int]]) -> PrefixTree:
    p = TokenizedPrompts.from_lists(seqs)
    return planning_tree(p.lengths, sort_sequences(p.tokens, p.offsets))


def shared_prefix(seqs: list[list[int]]) -> int:
    """Longest prefix of all seqs that leaves each >= 1 token of its own."""
    limit = min(len(s) for s in seqs) - 1
    k = 0
    while k < limit and all(s[k] == seqs[0][k] for s in seqs):
        k += 1
    return max(k, 0)


def partitions(items: list[int]):
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [[head], *part]
        for i in range(len(part)):
            yield [*part[:i], [head, *part[i]], *part[i + 1 :]]


def brute_force_reuse(seqs: list[list[int]]) -> int:
    """max over all partitions of sum over groups of (|group| - 1) * shared prefix."""
    best = 0
    for part in partitions(list(range(len(seqs)))):
        value = sum((len(g) - 1) * shared_prefix([seqs[i] for i in g]) for g in part)
        best = max(best, value)
    return best


def groups_as_sets(g: Grouping) -> dict[frozenset[int], int]:
    return {
        frozenset(np.flatnonzero(g.group_of == k).tolist()): int(g.prefix_len[k])
        for k in range(g.num_groups)
    }


def assert_valid(g: Grouping, seqs: list[list[int]]) -> None:
    assert sorted(set(g.group_of.tolist())) == list(range(g.num_groups))
    for members, prefix in groups_as_sets(g).items():
        if len(members) == 1:
            assert prefix == 0
        else:
            assert 1 <= prefix <= shared_prefix([seqs[i] for i in members])


@settings(max_examples=150, deadline=None)
@given(prompt_lists(max_prompts=7))
def test_optimal_equals_brute_force_and_bounds_algorithm_1(seqs):
    tree = plan_tree(seqs)
    best = brute_force_reuse(seqs)
    opt, paper, first = optimal_groups(tree), paper_groups(tree), first_level_groups(tree)
    for g in (opt, paper, first):
        assert_valid(g, seqs)
    assert opt.reuse == best
    assert first.reuse <= paper.reuse <= best


def letters(word: str) -> list[int]:
    return [ord(c) for c in word]


# Figure 4 of the paper, rebuilt from its text: the root's right child 'b' (1 token) is shared
# by prompts 2-6 (first-level reuse 4); b -> x (1 token) -> {p2, p3, x2 (6 tokens)}, and
# x2 holds p4 and p5, which share their first 1 + 1 + 6 = 8 tokens (reuse 8).
FIG4 = [
    letters("aqr"),  # p1
    letters("bxst"),  # p2
    letters("bxuv"),  # p3
    letters("bxyyyyyyij"),  # p4
    letters("bxyyyyyykl"),  # p5
    letters("bmn"),  # p6
]


def test_figure_4():
    tree = plan_tree(FIG4)
    first = first_level_groups(tree)
    assert groups_as_sets(first) == {frozenset({0}): 0, frozenset({1, 2, 3, 4, 5}): 1}
    assert first.reuse == 4
    # Fig. 4b: x forked and merged with x2 under b; Fig. 4c: b forked and merged with (x x2)
    paper = paper_groups(tree)
    assert groups_as_sets(paper) == {
        frozenset({0}): 0,
        frozenset({1, 2, 5}): 1,
        frozenset({3, 4}): 8,
    }
    assert paper.reuse == 10 == brute_force_reuse(FIG4) == optimal_groups(tree).reuse


def test_smallest_counterexample_to_algorithm_1():
    """4 prompts, 12 tokens (none smaller exists in an exhaustive search, see reuse.py)."""
    seqs = [[1, 2, 5], [1, 2, 6], [1, 3, 5], [1, 3, 6]]
    tree = plan_tree(seqs)
    paper, opt = paper_groups(tree), optimal_groups(tree)
    assert groups_as_sets(paper) == {frozenset({0, 1, 2, 3}): 1}
    assert paper.reuse == 3
    assert groups_as_sets(opt) == {frozenset({0, 1}): 2, frozenset({2, 3}): 2}
    assert opt.reuse == 4 == brute_force_reuse(seqs)


def test_singletons_and_short_prompts():
    seqs = [[7], [7], [], [3, 4], [3, 5], [9, 9, 9]]
    for g in (optimal_groups(plan_tree(seqs)), paper_groups(plan_tree(seqs))):
        # [7] twice: nothing to share once each keeps a token; [3,4]+[3,5] share [3]
        assert groups_as_sets(g) == {
            frozenset({0}): 0,
            frozenset({1}): 0,
            frozenset({2}): 0,
            frozenset({3, 4}): 1,
            frozenset({5}): 0,
        }


def test_deep_chain_is_exact():
    """Nested prompts (chat turns): a deep tree, where the DP is per ancestor depth."""
    rng = np.random.default_rng(0)
    chat = rng.integers(0, 9, 30).tolist()
    ends = np.cumsum(rng.integers(1, 5, 7)).tolist()  # one prompt per turn of one chat
    seqs = [[*chat[:end], 100 + k] for k, end in enumerate(ends)]
    tree = plan_tree(seqs)
    assert optimal_groups(tree).reuse == brute_force_reuse(seqs)
