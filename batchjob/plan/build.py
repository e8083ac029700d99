"""build_plan: TokenizedPrompts -> Plan (sort, prefix tree, first-level reuse, order);
``plan_job``: the same under a job's ``[scheduler]`` section.

Stages (names passed to ``on_stage`` when each one ends, for benchmarks):
- ``sort``: lexicographic order of the prompts and the LCP of sorted neighbours (one pass);
- ``tree``: compact prefix tree of the prompts without their last token (so every group
  prefix leaves each member >= 1 distinct token; same order, LCPs capped);
- ``reuse``: groups (exact DP by default; Algorithm 1 as written with ``algorithm="paper"``;
  the plain first level of the tree with ``enlarge=False``);
- ``groups``: members grouped, ascending by prompt position within a group;
- ``order``: Eq. 4 order (``order=False``: input order of each group's first member);
- ``stats``: Plan and PlanStats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np

from batchjob.config import SchedulerConfig
from batchjob.plan.order import group_order
from batchjob.plan.plan import Plan, PlanStats
from batchjob.plan.prefix_tree import PrefixTree, build_prefix_tree
from batchjob.plan.reuse import Grouping, first_level_groups, optimal_groups, paper_groups
from batchjob.plan.seqsort import SortedSequences, sort_sequences
from batchjob.plan.stats import plan_stats
from batchjob.tokenize.prompts import TokenizedPrompts

Algorithm = Literal["optimal", "paper"]


def _noop(stage: str) -> None:
    pass


def planning_tree(lengths: np.ndarray, srt: SortedSequences) -> PrefixTree:
    """Prefix tree of the prompts without their last token, from the full prompts' sort.

    A lexicographic order of the prompts is one of the truncated prompts too, and their
    neighbour LCPs are min(LCP, len_a - 1, len_b - 1).
    """
    capped = np.maximum(lengths - 1, 0)
    cap_sorted = capped[srt.order]
    lcp = srt.lcp.copy()
    lcp[1:] = np.minimum(lcp[1:], np.minimum(cap_sorted[1:], cap_sorted[:-1]))
    return build_prefix_tree(srt.order, capped, lcp)


def build_plan(
    prompts: TokenizedPrompts,
    *,
    enlarge: bool = SchedulerConfig.enlarge,  # defaults: scheduler.enlarge / .reorder
    order: bool = SchedulerConfig.reorder,
    algorithm: Algorithm = "optimal",
    on_stage: Callable[[str], None] | None = None,
) -> Plan:
    """Plan the prompts: prefix-sharing groups in execution order. Samples of one row
    (``prompts.sample_index``, adjacent) are planned as their row, then stand in its place
    side by side: they share its group's prefix, and all but the first copy the first's KV
    of their own prompt part (``sibling_saving``)."""
    if algorithm not in ("optimal", "paper"):
        raise ValueError(f"algorithm must be 'optimal' or 'paper', got {algorithm!r}")
    return _plan(prompts, enlarge, order, algorithm, on_stage)


def _plan(
    prompts: TokenizedPrompts,
    enlarge: bool,
    order: bool,
    algorithm: Algorithm,
    on_stage: Callable[[str], None] | None,
) -> Plan:
    """``build_plan`` after its checks: rows of several adapters apart, samples as their row,
    else the token plan."""
    if prompts.adapter is not None and len(np.unique(prompts.adapter)) > 1:
        return _plan_by_adapter(prompts, enlarge, order, algorithm)
    if prompts.sample_index is not None:
        return _plan_samples(prompts, enlarge, order, algorithm, on_stage)
    return _plan_tokens(prompts, enlarge, order, algorithm, on_stage)


def _plan_tokens(
    prompts: TokenizedPrompts,
    enlarge: bool,
    order: bool,
    algorithm: Algorithm,
    on_stage: Callable[[str], None] | None,
) -> Plan:
    """The plan of rows that are each one request (no samples) of one adapter."""
    stage = on_stage or _noop
    lengths = prompts.lengths
    srt = sort_sequences(prompts.tokens, prompts.offsets)
    multi_level = int(lengths.sum() - srt.lcp.sum())  # distinct prefixes of the full prompts
    stage("sort")

    tree = planning_tree(lengths, srt)
    stage("tree")

    grouping: Grouping
    if not enlarge:
        grouping = first_level_groups(tree)
    elif algorithm == "paper":
        grouping = paper_groups(tree)
    else:
        grouping = optimal_groups(tree)
    stage("reuse")

    members = np.argsort(grouping.group_of, kind="stable")  # by group, then by position
    offsets = np.zeros(grouping.num_groups + 1, dtype=np.int64)
    np.cumsum(grouping.sizes, out=offsets[1:])
    stage("groups")

    decode = prompts.max_tokens.astype(np.int64)
    perm = group_order(grouping.prefix_len, offsets, members, lengths, decode, by_ratio=order)
    sizes = np.diff(offsets)
    new_offsets = np.zeros_like(offsets)
    np.cumsum(sizes[perm], out=new_offsets[1:])
    starts = np.repeat(offsets[:-1][perm] - new_offsets[:-1], sizes[perm])
    members = members[starts + np.arange(len(members))]
    prefix = grouping.prefix_len[perm]
    stage("order")

    plan = Plan(
        group_prefix_len=prefix,
        group_offsets=new_offsets,
        members=members,
        row_ids=np.asarray(prompts.row_ids, dtype=np.int64)[members],
        decode_estimate=prompts.max_tokens.astype(np.int32)[members],
        stats=plan_stats(lengths, prefix, new_offsets, multi_level),
    )
    stage("stats")
    return plan


def plan_job(prompts: TokenizedPrompts, scheduler: SchedulerConfig) -> Plan:
    """The plan of a job's requests under its ``[scheduler]`` section (``scheduler.enlarge``,
    ``scheduler.reorder``): the one entry point of the plan stage for a job, whoever plans
    (``batchjob plan``, ``batchjob run``, ``batchjob.generate``, a cluster's driver, a backend
    that re-plans the requests it expands)."""
    return build_plan(prompts, enlarge=scheduler.enlarge, order=scheduler.reorder)


def _plan_samples(
    prompts: TokenizedPrompts,
    enlarge: bool,
    order: bool,
    algorithm: Algorithm,
    on_stage: Callable[[str], None] | None,
) -> Plan:
    """``build_plan`` of the rows (the first sample of each run of one row_id), each row's
    member then replaced by all its samples, in place."""
    ids = prompts.row_ids
    first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else ids[:0]
    count = np.diff(np.r_[first, len(ids)])
    rows = dataclasses.replace(prompts.take(first), sample_index=None)
    plan = _plan_tokens(rows, enlarge, order, algorithm, on_stage)
    per = count[plan.members]  # samples of each plan member
    members = np.repeat(first[plan.members], per) + _within(per)
    sizes = np.add.reduceat(per, plan.group_offsets[:-1]) if len(per) else per
    offsets = np.zeros(plan.num_groups + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    lengths = prompts.lengths
    prefix_each = np.repeat(plan.group_prefix_len, np.diff(plan.group_offsets))
    sibling = int(((per - 1) * (lengths[first[plan.members]] - prefix_each - 1)).sum())
    stats = plan_stats(
        lengths,
        plan.group_prefix_len,
        offsets,
        plan.stats.multi_level_prefill_tokens + int(((per - 1) * 1).sum()),
        sibling_saving=sibling,
    )
    return Plan(
        group_prefix_len=plan.group_prefix_len,
        group_offsets=offsets,
        members=members,
        row_ids=np.asarray(ids, dtype=np.int64)[members],
        decode_estimate=prompts.max_tokens.astype(np.int32)[members],
        stats=stats,
    )


def _plan_by_adapter(
    prompts: TokenizedPrompts, enlarge: bool, order: bool, algorithm: Algorithm
) -> Plan:
    """Groups keyed by (adapter, tokens): the rows of each adapter (``prompts.adapter``; -1:
    the base model) planned on their own, since KV computed under one adapter is no other's,
    then every group in one Eq. 4 order."""
    keys = np.asarray(prompts.adapter)
    prefix, sizes, members = [], [], []
    single = multi = 0
    for key in np.unique(keys):
        pos = np.flatnonzero(keys == key)
        sub = dataclasses.replace(prompts.take(pos), adapter=None)
        p = _plan(sub, enlarge, False, algorithm, None)
        prefix.append(p.group_prefix_len)
        sizes.append(np.diff(p.group_offsets))
        members.append(pos[p.members])
        single += p.stats.single_level_prefill_tokens
        multi += p.stats.multi_level_prefill_tokens
    prefix_len, size, grouped = (np.concatenate(x) for x in (prefix, sizes, members))
    offsets = np.zeros(len(size) + 1, dtype=np.int64)
    np.cumsum(size, out=offsets[1:])
    lengths, decode = prompts.lengths, prompts.max_tokens.astype(np.int64)
    perm = group_order(prefix_len, offsets, grouped, lengths, decode, by_ratio=order)
    new_offsets = np.zeros_like(offsets)
    np.cumsum(size[perm], out=new_offsets[1:])
    starts = np.repeat(offsets[:-1][perm] - new_offsets[:-1], size[perm])
    grouped = grouped[starts + np.arange(len(grouped))]
    logical = int(lengths.sum())
    stats = PlanStats(
        num_requests=len(lengths),
        num_groups=len(size),
        logical_prefill_tokens=logical,
        single_level_prefill_tokens=single,
        multi_level_prefill_tokens=multi,
        saving_ratio_single_level=1.0 - single / logical if logical else 0.0,
        saving_ratio_multi_level=1.0 - multi / logical if logical else 0.0,
    )
    return Plan(
        group_prefix_len=prefix_len[perm],
        group_offsets=new_offsets,
        members=grouped,
        row_ids=np.asarray(prompts.row_ids, dtype=np.int64)[grouped],
        decode_estimate=prompts.max_tokens.astype(np.int32)[grouped],
        stats=stats,
    )


def _within(counts: np.ndarray) -> np.ndarray:
    """int64: 0 .. c-1 for each count c, concatenated."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
