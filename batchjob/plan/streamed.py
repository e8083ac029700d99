"""Planning in bounded memory: spilled partitions -> one plan file in Eq. 4 order.

``plan_spilled`` takes a dataset spilled by a key of its leading tokens
(``batchjob.plan.partition``) and:

1. re-splits, by a deeper key, every partition whose estimated planning memory
   (``batchjob.plan.budget.plan_bytes``) exceeds the budget: the depth is the shallowest of
   ``DEPTHS`` whose largest sub-partition fits, found in one pass over the partition; a
   partition no key depth splits (rows identical in their first 512 tokens) is planned
   whole, over the budget, with a warning;
2. plans each partition on its own with ``build_plan`` (largest first) and spills its groups
   in its Eq. 4 order (ratio, first member's position), with their members;
3. merges the partitions' groups into the global Eq. 4 order, chunk by chunk (what is
   emitted is no later than anything not yet read), and writes the plan file as it goes.

Peak memory: the largest partition's planning, or the merge's buffers (a chunk of groups
per partition), whichever is larger; never the dataset.

What the split loses: two rows of different partitions differ within their first ``d``
tokens (``d`` the key depth, 4 for the first split), so a group of the in-memory plan whose
prefix is shorter than ``d`` tokens, with members in several partitions, becomes one group
per partition, each computing that prefix. Groups with prefixes of ``d`` tokens or more are
the in-memory planner's (the DP below depth ``d`` sees the same subtrees). The plan's
multi-level count is the sum of the partitions' trees: at most ``d - 1`` tokens per
partition boundary above the whole dataset's.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import SchedulerConfig
from batchjob.plan.budget import BYTES_PER_ROW, BYTES_PER_TOKEN, FILL, plan_bytes
from batchjob.plan.build import plan_job
from batchjob.plan.partition import DEPTHS, PartitionSpill, Rows, partition_of
from batchjob.plan.plan import PlanStats
from batchjob.plan.plan_io import plan_schema
from batchjob.plan.stats import PlanSummary
from batchjob.storage.atomic import Target, atomic_open

log = logging.getLogger(__name__)

GROUP = np.dtype(
    [
        ("neg_ratio", "<f8"),  # -R_group (Eq. 4); 0 without reorder
        ("first", "<i8"),  # position of the first member (the tie-break)
        ("prefix_len", "<i8"),
        ("size", "<i8"),
        ("kv_tokens", "<i8"),  # prefix + members' distinct tokens + decode estimates
    ]
)
MEMBER = np.dtype([("position", "<i8"), ("row_id", "<i8"), ("decode", "<i4")])
CHUNK_ROWS = 1 << 16  # rows per read of a partition being re-split
MERGE_GROUPS = 1 << 18  # groups the merge buffers over all partitions at most
WRITE_ROWS = 1 << 17  # plan-file rows per Parquet row group


@dataclass(frozen=True)
class PartPlan:
    """One partition's plan on disk: GROUP records in its Eq. 4 order, MEMBER records."""

    groups: Path
    members: Path
    num_groups: int


@dataclass(frozen=True)
class StreamedPlan:
    """What planning in partitions did: the plan's numbers, written to the plan file."""

    stats: PlanStats
    summary: PlanSummary
    size_counts: dict[int, int]  # members per group -> groups
    largest_group: tuple[int, int, int]  # (group index, members, KV tokens); (-1, 0, 0): none
    partitions: int  # partitions planned
    depths: tuple[int, ...]  # key depths of the splits, shallowest first
    largest_partition: tuple[int, int]  # (rows, tokens) of the largest partition planned
    over_budget: int  # partitions no key depth brought within the budget


class Counts:
    """A histogram of non-negative integers: exact distribution numbers at any size."""

    DENSE = 1 << 20

    def __init__(self) -> None:
        self.dense = np.zeros(0, dtype=np.int64)
        self.sparse: dict[int, int] = {}

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.int64)
        small = v < self.DENSE
        bc = np.bincount(v[small])
        if len(bc) > len(self.dense):
            self.dense = np.concatenate([self.dense, np.zeros(len(bc) - len(self.dense), np.int64)])
        self.dense[: len(bc)] += bc
        if not small.all():
            for k, c in zip(*np.unique(v[~small], return_counts=True), strict=True):
                self.sparse[int(k)] = self.sparse.get(int(k), 0) + int(c)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(values ascending, their counts), counts > 0."""
        nz = np.flatnonzero(self.dense)
        big = sorted(self.sparse)
        values = np.concatenate([nz, np.asarray(big, dtype=np.int64)])
        counts = np.concatenate(
            [self.dense[nz], np.asarray([self.sparse[k] for k in big], np.int64)]
        )
        return values.astype(np.int64), counts.astype(np.int64)

    def dist(self, lo: int = 0) -> dict[str, float]:
        """mean, p50, p90, p99, max of the values >= ``lo``, as ``np.percentile`` (linear)."""
        values, counts = self.items()
        keep = values >= lo
        values, counts = values[keep], counts[keep]
        n = int(counts.sum())
        if n == 0:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
        cum = np.cumsum(counts)

        def at(i: int) -> float:
            return float(values[int(np.searchsorted(cum, i, side="right"))])

        def pct(q: float) -> float:
            r = q / 100 * (n - 1)
            lo_i = int(np.floor(r))
            a, b = at(lo_i), at(min(lo_i + 1, n - 1))
            return a + (b - a) * (r - lo_i)

        return {
            "mean": float((values.astype(np.float64) * counts).sum() / n),
            "p50": pct(50),
            "p90": pct(90),
            "p99": pct(99),
            "max": float(values[-1]),
        }


class _Totals:
    """Sums and histograms over the partitions' plans."""

    def __init__(self) -> None:
        self.requests = self.groups = self.logical = self.single = self.multi = 0
        self.sizes, self.prefix, self.distinct, self.decode = Counts(), Counts(), Counts(), Counts()

    def add(self, stats: PlanStats, sizes, prefix, distinct, decode) -> None:
        self.requests += stats.num_requests
        self.groups += stats.num_groups
        self.logical += stats.logical_prefill_tokens
        self.single += stats.single_level_prefill_tokens
        self.multi += stats.multi_level_prefill_tokens
        self.sizes.add(sizes)
        self.prefix.add(prefix[sizes >= 2])
        self.distinct.add(distinct)
        self.decode.add(decode)

    def stats(self) -> PlanStats:
        def ratio(x: int) -> float:
            return 1.0 - x / self.logical if self.logical else 0.0

        return PlanStats(
            num_requests=self.requests,
            num_groups=self.groups,
            logical_prefill_tokens=self.logical,
            single_level_prefill_tokens=self.single,
            multi_level_prefill_tokens=self.multi,
            saving_ratio_single_level=ratio(self.single),
            saving_ratio_multi_level=ratio(self.multi),
        )

    def summary(self, stats: PlanStats) -> PlanSummary:
        values, counts = self.sizes.items()
        shared = values >= 2
        return PlanSummary(
            num_requests=stats.num_requests,
            num_groups=stats.num_groups,
            num_shared_groups=int(counts[shared].sum()),
            requests_in_shared_groups=int((values[shared] * counts[shared]).sum()),
            share_degree_histogram={int(k): int(c) for k, c in zip(values, counts, strict=True)},
            share_degree=self.sizes.dist(lo=2),
            prefix_len=self.prefix.dist(),
            distinct_len=self.distinct.dist(),
            decode_estimate=self.decode.dist(),
            saving_ratio_single_level=stats.saving_ratio_single_level,
            saving_ratio_multi_level=stats.saving_ratio_multi_level,
        )


def _row_bytes(rows: Rows) -> np.ndarray:
    return BYTES_PER_ROW + BYTES_PER_TOKEN * rows.rows["length"].astype(np.float64)


def resplit(spill: PartitionSpill, part: int, budget: int, folder: Path) -> PartitionSpill | None:
    """Partition ``part`` of ``spill`` split again by the shallowest deeper key whose largest
    sub-partition fits ``budget`` (else the deepest that splits it most); None when no depth
    splits it at all. The sub-partitions are written under ``folder``; ``part``'s files go."""
    need = plan_bytes(int(spill.num_rows[part]), int(spill.num_tokens[part]))
    n_sub = max(2, -(-need // max(int(budget * FILL), 1)))
    depths = tuple(d for d in DEPTHS if d > spill.depth)
    if not depths:
        return None
    load = np.zeros((len(depths), n_sub))
    for chunk in spill.chunks(part, CHUNK_ROWS):
        keys = chunk.keys(depths)
        weight = _row_bytes(chunk)
        for i in range(len(depths)):
            load[i] += np.bincount(partition_of(keys[i], n_sub), weights=weight, minlength=n_sub)
    peak = load.max(axis=1)
    fits = np.flatnonzero(peak <= budget)
    pick = int(fits[0]) if len(fits) else int(np.argmin(peak))
    if peak[pick] >= load[pick].sum():  # every row in one sub-partition: nothing gained
        return None
    sub = PartitionSpill(folder, n_sub, depth=depths[pick], name=f"{spill.name}{part:05d}r")
    for chunk in spill.chunks(part, CHUNK_ROWS):
        key = chunk.keys((sub.depth,))[0]
        sub.add_to(chunk, chunk.offsets, partition_of(key, n_sub))
    spill.remove(part)
    return sub


def fit_partitions(spill: PartitionSpill, budget: int, folder: Path) -> tuple[list, set[int], int]:
    """(spill, partition) pairs to plan, the key depths used, partitions left over budget."""
    todo: list[tuple[PartitionSpill, int]] = []
    depths = {spill.depth}
    over = 0
    for p in range(spill.num_parts):
        if not spill.num_rows[p]:
            continue
        if plan_bytes(int(spill.num_rows[p]), int(spill.num_tokens[p])) <= budget:
            todo.append((spill, p))
            continue
        sub = resplit(spill, p, budget, folder)
        if sub is None:
            todo.append((spill, p))
            over += 1
            continue
        depths.add(sub.depth)
        for q in range(sub.num_parts):
            if sub.num_rows[q]:
                todo.append((sub, q))
                over += plan_bytes(int(sub.num_rows[q]), int(sub.num_tokens[q])) > budget
    return todo, depths, over


def _plan_part(
    rows: Rows,
    scheduler: SchedulerConfig,
    prefix: Path,
    totals: _Totals,
    samples: tuple[int, bool] = (1, False),
    by_rows: bool = False,
) -> PartPlan:
    """Plan one partition's requests (every row's ``samples``); its groups (Eq. 4 order)
    and members spilled at ``prefix``. ``by_rows``: a group's ratio counts each row once,
    not each sample, as ``plan.build`` orders the groups of rows of one adapter."""
    prompts, pos = rows.requests(samples)
    plan = plan_job(prompts, scheduler)
    sizes = np.diff(plan.group_offsets)
    g = plan.num_groups
    lengths = prompts.lengths[plan.members]
    decode = plan.decode_estimate.astype(np.int64)
    seg = np.repeat(np.arange(g), sizes)
    groups = np.zeros(g, dtype=GROUP)
    if scheduler.reorder:  # R_group as ``group_order`` computes it (the same sums, order)
        # samples of a row: ordered as their row (``plan.build``), its first sample alone
        w = np.ones(len(plan.members), dtype=np.float64)
        if by_rows and len(w):
            rid = plan.row_ids
            w[1:] = rid[1:] != rid[:-1]
            w[plan.group_offsets[:-1][sizes > 0]] = 1.0
        row_sizes = np.bincount(seg, weights=w, minlength=g)
        prompt_tokens = np.bincount(seg, weights=lengths * w, minlength=g)
        decode_sum = np.bincount(seg, weights=decode * w, minlength=g)
        prefill = prompt_tokens - (row_sizes - 1) * plan.group_prefix_len
        groups["neg_ratio"] = -(decode_sum / np.maximum(prefill, 1))
    groups["first"] = pos[plan.members[plan.group_offsets[:-1]]] if g else 0
    groups["prefix_len"] = plan.group_prefix_len
    groups["size"] = sizes
    distinct = lengths - np.repeat(plan.group_prefix_len, sizes)
    own = np.bincount(seg, weights=distinct + decode, minlength=g).astype(np.int64)
    groups["kv_tokens"] = plan.group_prefix_len + own
    members = np.zeros(len(plan.members), dtype=MEMBER)
    members["position"] = pos[plan.members]
    members["row_id"] = plan.row_ids
    members["decode"] = plan.decode_estimate
    out = PartPlan(prefix.with_suffix(".groups"), prefix.with_suffix(".members"), g)
    groups.tofile(out.groups)
    members.tofile(out.members)
    totals.add(plan.stats, sizes, plan.group_prefix_len, distinct, decode)
    return out


def _before(keys: np.ndarray, bound: np.void) -> np.ndarray:
    """bool: GROUP records ordered at or before ``bound`` (by -ratio, then first)."""
    nr, first = keys["neg_ratio"], keys["first"]
    return (nr < bound["neg_ratio"]) | ((nr == bound["neg_ratio"]) & (first <= bound["first"]))


class _Merge:
    """The partitions' groups in one Eq. 4 order, chunk by chunk."""

    def __init__(self, parts: list[PartPlan]):
        self.parts = parts
        self.chunk = max(256, MERGE_GROUPS // max(len(parts), 1))
        self.read = [0] * len(parts)  # groups read from each partition
        self.members_read = [0] * len(parts)
        self.buf = [np.zeros(0, dtype=GROUP) for _ in parts]

    def _fill(self, i: int) -> None:
        p = self.parts[i]
        n = min(self.chunk, p.num_groups - self.read[i])
        if n > 0 and not len(self.buf[i]):
            off = self.read[i] * GROUP.itemsize
            self.buf[i] = np.fromfile(p.groups, dtype=GROUP, count=n, offset=off)
            self.read[i] += n

    def rounds(self):
        """Yields (groups: GROUP [k], members: MEMBER [sum of sizes]) in plan order."""
        while True:
            for i in range(len(self.parts)):
                self._fill(i)
            live = [i for i in range(len(self.parts)) if len(self.buf[i])]
            if not live:
                return
            pending = [i for i in live if self.read[i] < self.parts[i].num_groups]
            bound = None
            if pending:  # the earliest of the pending partitions' last buffered keys
                last = np.array([self.buf[i][-1] for i in pending], dtype=GROUP)
                bound = last[np.lexsort((last["first"], last["neg_ratio"]))[0]]
            taken_g, taken_m, base = [], [], 0
            for i in live:
                b = self.buf[i]
                k = len(b) if bound is None else int(_before(b, bound).sum())
                if not k:
                    continue
                g, self.buf[i] = b[:k], b[k:]
                count = int(g["size"].sum())
                off = self.members_read[i] * MEMBER.itemsize
                m = np.fromfile(self.parts[i].members, dtype=MEMBER, count=count, offset=off)
                self.members_read[i] += count
                start = base + np.cumsum(g["size"]) - g["size"]
                taken_g.append((g, start))
                taken_m.append(m)
                base += count
            groups = np.concatenate([g for g, _ in taken_g])
            starts = np.concatenate([s for _, s in taken_g])
            order = np.lexsort((groups["first"], groups["neg_ratio"]))
            members = np.concatenate(taken_m)
            idx = _ranges(starts[order], groups["size"][order])
            yield groups[order], members[idx]


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(int(sizes.sum()), dtype=np.int64) - seg)


def _write(parts: list[PartPlan], stats: PlanStats, path: Target) -> tuple[int, int, int]:
    """The merged plan to ``path`` (atomically); returns the largest group by KV tokens
    (index, members, tokens), the first such in plan order."""
    schema = plan_schema(stats)
    best = (-1, 0, 0)
    group_at = 0
    pending: list[pa.Table] = []
    rows_pending = 0
    with atomic_open(path, "wb") as f, pq.ParquetWriter(f, schema) as w:
        for groups, members in _Merge(parts).rounds():
            g = int(np.argmax(groups["kv_tokens"]))
            if groups["kv_tokens"][g] > best[2]:
                best = (group_at + g, int(groups["size"][g]), int(groups["kv_tokens"][g]))
            sizes = groups["size"]
            idx = np.repeat(np.arange(group_at, group_at + len(groups), dtype=np.int64), sizes)
            group_at += len(groups)
            cols = [
                idx,
                members["row_id"],
                members["position"],
                np.repeat(groups["prefix_len"], sizes),
                members["decode"],
            ]
            pending.append(pa.Table.from_arrays([pa.array(c) for c in cols], schema=schema))
            rows_pending += len(members)
            if rows_pending >= WRITE_ROWS:
                w.write_table(pa.concat_tables(pending))
                pending, rows_pending = [], 0
        if pending:
            w.write_table(pa.concat_tables(pending))
        if group_at == 0:
            w.write_table(schema.empty_table())
    return best


def plan_spilled(
    spill: PartitionSpill,
    budget: int,
    path: Target,
    scheduler: SchedulerConfig | None = None,
    *,
    on_partition: Callable[[int, int], None] | None = None,
    samples: tuple[int, bool] = (1, False),
    adapters: bool = False,
) -> StreamedPlan:
    """Plan the spilled dataset within ``budget`` bytes; write the plan to ``path``.
    ``scheduler``: the job's section (``plan_job``; None: the defaults); ``samples``:
    ``sampling.n`` and whether rows set their own (``Rows.requests``); ``adapters``: the
    rows run with several LoRA adapters (their groups ordered by their samples' sums, as
    ``plan.build`` orders them).

    ``on_partition(rows, tokens)``: called before each partition is planned (logging). The
    spill's folder holds the work files and is removed at the end, whatever happens."""
    work = spill.folder
    scheduler = scheduler or SchedulerConfig()
    try:
        todo, depths, over = fit_partitions(spill, budget, work)
        if over:
            log.warning(
                "%d partitions exceed scheduler.plan_memory = %d bytes even split by their "
                "first %d tokens (rows identical that far); planned whole",
                over,
                budget,
                max(DEPTHS),
            )
        todo.sort(key=lambda sp: -int(sp[0].num_tokens[sp[1]]))  # largest first
        totals = _Totals()
        parts: list[PartPlan] = []
        largest = (0, 0)
        for n, (s, p) in enumerate(todo):
            size = (int(s.num_rows[p]), int(s.num_tokens[p]))
            largest = max(largest, size, key=lambda x: plan_bytes(*x))
            if on_partition:
                on_partition(*size)
            by_rows = samples != (1, False) and not adapters
            parts.append(
                _plan_part(s.read(p), scheduler, work / f"plan{n:05d}", totals, samples, by_rows)
            )
            s.remove(p)
        stats = totals.stats()
        best = _write(parts, stats, path)
        return StreamedPlan(
            stats=stats,
            summary=totals.summary(stats),
            size_counts=dict(zip(*(a.tolist() for a in totals.sizes.items()), strict=True)),
            largest_group=best,
            partitions=len(parts),
            depths=tuple(sorted(depths)),
            largest_partition=largest,
            over_budget=over,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
