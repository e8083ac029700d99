"""Split a plan into shards for the workers of a cluster: groups whole, cost balanced.

A group's cost is what its worker spends on it: the prefill tokens it computes after sharing
(the prefix once, then every member's distinct part) plus its members' decode estimates,
weighted by ``DECODE_WEIGHT`` (a decode token costs one sequence-step of a batched forward,
which on the engines here takes longer per token than a chunked prefill token).

Placement is LPT (longest processing time first, "max-min" in SCLS): groups by falling
cost, each to the least-loaded shard; its makespan is at most (4/3 - 1/(3S)) of the
optimum (Graham 1969). Past ``EXACT_GROUPS`` groups the small tail is placed in one
vectorised pass instead (every tail group is no larger than the smallest group placed one by
one): the shards are filled, least-loaded first, up to the common level in falling cost
order, so no shard ends more than one tail group from that level.

Pure numpy (no torch, no Ray): the driver plans and shards, the workers run.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from batchjob.plan.plan import Plan
from batchjob.plan.stats import plan_stats
from batchjob.tokenize.prompts import TokenizedPrompts

DECODE_WEIGHT = 2.0  # cost of one decode token in prefill tokens
EXACT_GROUPS = 65536  # groups placed one by one (a heap); the rest in one vectorised pass


@dataclass(frozen=True)
class Sharding:
    """Groups assigned to shards."""

    shard_of_group: np.ndarray  # int32 [G]: the shard each plan group runs on
    load: np.ndarray  # float64 [S]: total cost of each shard

    @property
    def num_shards(self) -> int:
        return len(self.load)

    @property
    def spread(self) -> float:
        """(max load - min load) / mean load: 0 is perfect balance."""
        mean = float(self.load.mean()) if len(self.load) else 0.0
        return float(self.load.max() - self.load.min()) / mean if mean > 0 else 0.0

    def groups(self, shard: int) -> np.ndarray:
        """int64: the plan's group indices of ``shard``, in plan order."""
        return np.flatnonzero(self.shard_of_group == shard)


def group_costs(
    plan: Plan, lengths: np.ndarray, decode_weight: float = DECODE_WEIGHT
) -> np.ndarray:
    """float64 [G]: prefill tokens after sharing + decode_weight * decode estimate, per group.

    ``lengths``: prompt length of each prompt position (``TokenizedPrompts.lengths``)."""
    g = plan.num_groups
    if g == 0:
        return np.zeros(0, dtype=np.float64)
    sizes = np.diff(plan.group_offsets)
    starts = plan.group_offsets[:-1]
    member_len = np.asarray(lengths, dtype=np.int64)[plan.members]
    prompt_tokens = np.add.reduceat(member_len, starts)
    decode = np.add.reduceat(plan.decode_estimate.astype(np.int64), starts)
    prefill = prompt_tokens - (sizes - 1) * plan.group_prefix_len
    return prefill.astype(np.float64) + decode_weight * decode.astype(np.float64)


def balance(costs: np.ndarray, num_shards: int, exact_groups: int = EXACT_GROUPS) -> Sharding:
    """LPT placement of groups of ``costs`` onto ``num_shards`` shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    costs = np.asarray(costs, dtype=np.float64)
    shard_of = np.zeros(len(costs), dtype=np.int32)
    load = np.zeros(num_shards, dtype=np.float64)
    order = np.argsort(-costs, kind="stable")  # falling cost; ties: plan order
    head, tail = order[:exact_groups], order[exact_groups:]

    heap = [(0.0, s) for s in range(num_shards)]  # (load, shard): least loaded on top
    for g, c in zip(head.tolist(), costs[head].tolist(), strict=True):
        lo, s = heap[0]
        shard_of[g] = s
        heapq.heapreplace(heap, (lo + c, s))
    for lo, s in heap:
        load[s] = lo

    if len(tail):
        # fill the shards, least loaded first, to the common level; each tail group goes
        # to the shard whose room its cost midpoint falls in
        c = costs[tail]
        level = (load.sum() + c.sum()) / num_shards
        by_load = np.argsort(load, kind="stable")
        room = np.cumsum(np.maximum(level - load[by_load], 0.0))
        mid = np.cumsum(c) - c / 2
        slot = np.minimum(np.searchsorted(room, mid, side="right"), num_shards - 1)
        shard_of[tail] = by_load[slot]
        load += np.bincount(shard_of[tail], weights=c, minlength=num_shards)
    return Sharding(shard_of, load)


def shard_plan(
    plan: Plan, lengths: np.ndarray, num_shards: int, decode_weight: float = DECODE_WEIGHT
) -> Sharding:
    """The plan's groups balanced over ``num_shards`` shards by ``group_costs``."""
    return balance(group_costs(plan, lengths, decode_weight), num_shards)


def split(
    prompts: TokenizedPrompts, plan: Plan, sharding: Sharding
) -> Iterator[tuple[TokenizedPrompts, Plan]]:
    """Every shard's prompts and plan, as ``take_groups`` gives them, in one pass over the
    rows and tokens (``take_groups`` per shard reads all of them each time)."""
    sizes = np.diff(plan.group_offsets)
    row_shard = np.empty(len(prompts), dtype=np.int32)
    row_shard[plan.members] = np.repeat(sharding.shard_of_group, sizes)
    by_shard = np.argsort(row_shard, kind="stable")  # rows by shard, by position within
    row_start = np.zeros(sharding.num_shards + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_shard, minlength=sharding.num_shards), out=row_start[1:])
    local = np.empty(len(prompts), dtype=np.int64)  # position -> position in its shard
    local[by_shard] = np.arange(len(prompts)) - np.repeat(row_start[:-1], np.diff(row_start))
    groups_by_shard = np.argsort(sharding.shard_of_group, kind="stable")
    group_start = np.zeros(sharding.num_shards + 1, dtype=np.int64)
    np.cumsum(
        np.bincount(sharding.shard_of_group, minlength=sharding.num_shards), out=group_start[1:]
    )
    lengths = prompts.lengths
    for s in range(sharding.num_shards):
        rows = by_shard[row_start[s] : row_start[s + 1]]
        groups = groups_by_shard[group_start[s] : group_start[s + 1]]
        yield prompts.take(rows), _sub_plan(plan, groups, lengths[rows], lambda pos: local[pos])


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """int64: starts[i] .. starts[i] + sizes[i] - 1, concatenated."""
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(int(sizes.sum()), dtype=np.int64) - seg)


def _sub_plan(plan: Plan, groups: np.ndarray, lengths: np.ndarray, renumber) -> Plan:
    """The plan of ``groups`` (ascending), members renumbered by ``renumber(positions)``."""
    sizes = np.diff(plan.group_offsets)[groups]
    offsets = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    idx = _ranges(plan.group_offsets[:-1][groups], sizes)
    prefix = plan.group_prefix_len[groups]
    single = plan_stats(lengths, prefix, offsets, 0).single_level_prefill_tokens
    return Plan(
        group_prefix_len=prefix,
        group_offsets=offsets,
        members=renumber(plan.members[idx]),
        row_ids=plan.row_ids[idx],
        decode_estimate=plan.decode_estimate[idx],
        stats=plan_stats(lengths, prefix, offsets, single),
    )


def take_groups(
    prompts: TokenizedPrompts, plan: Plan, groups: np.ndarray
) -> tuple[TokenizedPrompts, Plan]:
    """The prompts and plan of the given groups (kept in plan order), positions renumbered.

    The sub-plan's ``multi_level_prefill_tokens`` is its single-level count (the tree of a
    shard is not rebuilt)."""
    groups = np.sort(np.asarray(groups, dtype=np.int64))
    sizes = np.diff(plan.group_offsets)[groups]
    keep = np.zeros(len(prompts), dtype=bool)
    keep[plan.members[_ranges(plan.group_offsets[:-1][groups], sizes)]] = True
    new_pos = np.cumsum(keep) - 1  # old position -> position among the kept prompts
    sub = prompts.take(keep)  # settings keyed by row_id: valid for any selection
    return sub, _sub_plan(plan, groups, sub.lengths, lambda pos: new_pos[pos])
