"""build_plan end to end: invariants, Eq. 2 stats, Eq. 4 order, summaries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.plan import build_plan, largest_group_kv_bytes, summarize_plan
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts
from tests.plan.test_prefix_tree import naive_compact_trie, prompt_lists
from tests.plan.test_reuse import brute_force_reuse


def groups(plan: Plan) -> list[tuple[list[int], int]]:
    return [
        (plan.group_members(g).tolist(), int(plan.group_prefix_len[g]))
        for g in range(plan.num_groups)
    ]


def check_plan(plan: Plan, prompts: TokenizedPrompts) -> None:
    n = len(prompts)
    assert sorted(plan.members.tolist()) == list(range(n))
    assert plan.group_offsets[0] == 0 and plan.group_offsets[-1] == n
    assert (np.diff(plan.group_offsets) >= 1).all()
    assert (plan.row_ids == prompts.row_ids[plan.members]).all()
    assert (plan.decode_estimate == prompts.max_tokens[plan.members]).all()
    for members, prefix in groups(plan):
        if len(members) == 1:
            assert prefix == 0
        head = prompts.row(members[0])[:prefix]
        for m in members:
            assert len(prompts.row(m)) >= prefix + (len(members) > 1)  # >= 1 distinct token
            assert (prompts.row(m)[:prefix] == head).all()
    s = plan.stats
    distinct = sum(len(prompts.row(m)) - p for ms, p in groups(plan) for m in ms)
    assert s.single_level_prefill_tokens == int(plan.group_prefix_len.sum()) + distinct
    assert s.logical_prefill_tokens == int(prompts.lengths.sum())
    assert s.num_requests == n and s.num_groups == plan.num_groups


@settings(max_examples=80, deadline=None)
@given(prompt_lists(max_prompts=7), st.integers(0, 2**16))
def test_plan_invariants_and_stats(seqs, seed):
    rng = np.random.default_rng(seed)
    prompts = TokenizedPrompts.from_lists(
        seqs, row_ids=rng.permutation(len(seqs)) + 100, max_tokens=rng.integers(1, 50, len(seqs))
    )
    plan = build_plan(prompts)
    check_plan(plan, prompts)
    logical = int(prompts.lengths.sum())
    assert plan.stats.single_level_prefill_tokens == logical - brute_force_reuse(seqs)
    assert plan.stats.multi_level_prefill_tokens == naive_compact_trie(seqs)[1]
    for kw in ({"enlarge": False}, {"algorithm": "paper"}, {"order": False}):
        check_plan(build_plan(prompts, **kw), prompts)


@settings(max_examples=40, deadline=None)
@given(prompt_lists(max_prompts=8), st.integers(0, 2**16))
def test_groups_do_not_depend_on_input_order(seqs, seed):
    perm = np.random.default_rng(seed).permutation(len(seqs))
    a = TokenizedPrompts.from_lists(seqs)
    b = TokenizedPrompts.from_lists([seqs[i] for i in perm], row_ids=perm)

    def by_row_id(plan: Plan) -> set[tuple[frozenset[int], int]]:
        return {
            (frozenset(plan.row_ids[plan.group_offsets[g] : plan.group_offsets[g + 1]]), p)
            for g, p in enumerate(plan.group_prefix_len.tolist())
        }

    assert by_row_id(build_plan(a)) == by_row_id(build_plan(b))


def test_eq2_hand_computed():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8]]
    plan = build_plan(TokenizedPrompts.from_lists(seqs), order=False)
    # best single level: {0,1,2} share [1,2] (reuse 2*2=4 beats {0,1} sharing [1,2,3]: 3)
    assert groups(plan) == [([0, 1, 2], 2), ([3], 0)]
    s = plan.stats
    assert s.logical_prefill_tokens == 13
    assert s.single_level_prefill_tokens == 2 + (2 + 2 + 1) + 2 == 9
    # distinct prefixes: 1 | 1 2 | 1 2 3 | 1 2 3 4 | 1 2 3 5 | 1 2 6 | 7 | 7 8
    assert s.multi_level_prefill_tokens == 8
    assert s.saving_ratio_single_level == pytest.approx(1 - 9 / 13)
    assert s.saving_ratio_multi_level == pytest.approx(1 - 8 / 13)
    first = build_plan(TokenizedPrompts.from_lists(seqs), enlarge=False, order=False)
    assert groups(first) == [([0, 1, 2], 2), ([3], 0)]  # the root's child [1 2] is the group


def test_eq4_order_hand_computed():
    seqs = [
        [9, 9],  # 0: alone, R = 3 / 2 = 1.5
        [1, 1, 1, 1, 2, 3],  # 1,2: share 4 tokens, R = (10 + 10) / (4 + 2 + 2) = 2.5
        [1, 1, 1, 1, 4, 5],
        [8],  # 3: alone, R = 100 / 1
        [7, 7],  # 4: alone, R = 3 / 2 = 1.5, tie with prompt 0: input order
    ]
    prompts = TokenizedPrompts.from_lists(seqs, max_tokens=np.array([3, 10, 10, 100, 3]))
    assert groups(build_plan(prompts)) == [([3], 0), ([1, 2], 4), ([0], 0), ([4], 0)]
    assert groups(build_plan(prompts, order=False)) == [([0], 0), ([1, 2], 4), ([3], 0), ([4], 0)]


def test_empty_and_tiny_inputs():
    for seqs in ([], [[]], [[5]], [[], [], [1, 2]]):
        prompts = TokenizedPrompts.from_lists(seqs)
        plan = build_plan(prompts)
        check_plan(plan, prompts)
        assert plan.stats.single_level_prefill_tokens == sum(map(len, seqs))
    with pytest.raises(ValueError, match="algorithm"):
        build_plan(TokenizedPrompts.from_lists([[1]]), algorithm="greedy")  # type: ignore[arg-type]


def test_summary_and_largest_group_kv():
    seqs = [[1, 1, 1, 2], [1, 1, 1, 3], [1, 1, 1, 4, 4], [6, 6]]
    prompts = TokenizedPrompts.from_lists(seqs, max_tokens=np.array([5, 5, 5, 50]))
    plan = build_plan(prompts, order=False)
    assert groups(plan) == [([0, 1, 2], 3), ([3], 0)]
    summary = summarize_plan(plan, prompts)
    assert summary.num_groups == 2 and summary.num_shared_groups == 1
    assert summary.requests_in_shared_groups == 3
    assert summary.share_degree_histogram == {1: 1, 3: 1}
    assert summary.prefix_len["max"] == 3 and summary.distinct_len["max"] == 2
    assert summary.to_dict()["share_degree_histogram"] == {"1": 1, "3": 1}
    # KV tokens: group 0 = 3 + (1 + 1 + 2) + 3 * 5 = 22; group 1 = 2 + 50 = 52
    assert largest_group_kv_bytes(plan, prompts, bytes_per_token=10) == (1, 520)


def test_plan_job_is_build_plan_under_the_scheduler_section():
    from batchjob.config import SchedulerConfig
    from batchjob.plan.build import plan_job

    prompts = TokenizedPrompts.from_lists([[1, 2, 3, 4], [1, 2, 3, 5], [9, 8], [1, 2, 7]])
    for enlarge in (True, False):
        for reorder in (True, False):
            got = plan_job(prompts, SchedulerConfig(enlarge=enlarge, reorder=reorder))
            want = build_plan(prompts, enlarge=enlarge, order=reorder)
            for f in ("group_prefix_len", "group_offsets", "members"):
                assert np.array_equal(getattr(got, f), getattr(want, f)), f
            assert got.stats == want.stats


def test_jobs_plan_through_plan_job_only():
    """Every stage plans a job through ``plan_job`` (the scheduler section), so
    ``build_plan(`` is called once in batchjob/: by plan_job (``plan.build``'s recursions for
    samples and adapters go through its private ``_plan``)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["grep", "-rn", "build_plan(", "batchjob"], cwd=root, capture_output=True, text=True
    ).stdout
    calls = [x for x in out.splitlines() if "def build_plan" not in x]
    assert len(calls) == 1, calls
    assert all(x.startswith("batchjob/plan/build.py:") for x in calls), calls
