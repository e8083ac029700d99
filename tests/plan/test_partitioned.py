"""Planning in partitions (bounded memory) against the in-memory planner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchjob.plan.budget import plan_bytes
from batchjob.plan.build import build_plan
from batchjob.plan.order import group_order
from batchjob.plan.partition import FIRST_DEPTH, ROW, PartitionSpill, Rows, prefix_keys
from batchjob.plan.plan_io import read_plan
from batchjob.plan.stats import _dist
from batchjob.plan.streamed import Counts, plan_spilled
from batchjob.testing.workloads import make_workload
from batchjob.tokenize.prompts import TokenizedPrompts


def workload(name: str, scale: float, len_scale: float = 0.25) -> TokenizedPrompts:
    t = make_workload(name, scale=scale, len_scale=len_scale)
    arr = t.column("prompt").combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    tokens = arr.values.to_numpy().astype(np.int32)
    n = len(offsets) - 1
    mt = t.column("max_tokens").to_numpy().astype(np.int32)
    return TokenizedPrompts(np.arange(n, dtype=np.int64) * 3 + 7, tokens, offsets, mt)


def spill_of(p: TokenizedPrompts, folder: Path, parts: int, batch: int = 500) -> PartitionSpill:
    """``p`` spilled batch by batch, as ``batchjob plan`` spills its input."""
    rows = np.zeros(len(p), dtype=ROW)
    rows["position"] = np.arange(len(p))
    rows["row_id"] = p.row_ids
    rows["length"] = p.lengths
    rows["max_tokens"] = p.max_tokens
    spill = PartitionSpill(folder / "spill", parts)
    for s in range(0, len(p), batch):
        sub = p.take(np.arange(s, min(s + batch, len(p))))
        spill.add(Rows(rows[s : s + batch], sub.tokens))
    return spill


def test_prefix_keys_follow_the_first_tokens() -> None:
    p = TokenizedPrompts.from_lists(
        [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8, 8], [1, 2, 3, 5], [1, 2, 3], [1, 2, 3]]
    )
    k4, k3 = prefix_keys(p.tokens, p.offsets, (4, 3))
    assert k4[0] == k4[1]  # equal in their first 4 tokens
    assert len({k4[0], k4[2], k4[3]}) == 3  # differ within 4, or shorter
    assert k4[3] == k4[4]
    assert len(set(k3.tolist())) == 1  # all equal in their first 3


@pytest.mark.parametrize(
    ("name", "scale"),
    [("micro-200-2000-s4", 1.0), ("case1", 0.3), ("natural-qa", 3.0), ("nosharing", 1.0)],
)
def test_partitioned_plan_is_the_in_memory_plan(tmp_path: Path, name: str, scale: float) -> None:
    """Groups with prefixes of FIRST_DEPTH tokens or more never cross partitions: on these
    workloads the plan is the in-memory one, group for group, in the same order. A partition
    over the budget (case1, natural-qa: an instruction shared by every row) is split again by
    a deeper key."""
    p = workload(name, scale)
    want = build_plan(p)
    budget = plan_bytes(len(p), len(p.tokens)) // 5
    got = plan_spilled(spill_of(p, tmp_path, 8), budget, tmp_path / "plan.parquet")
    plan = read_plan(tmp_path / "plan.parquet")
    for f in ("group_prefix_len", "group_offsets", "members", "row_ids", "decode_estimate"):
        assert np.array_equal(getattr(plan, f), getattr(want, f)), f
    assert got.stats == plan.stats
    assert got.stats.single_level_prefill_tokens == want.stats.single_level_prefill_tokens
    # the multi-level count is the partitions' trees: a prefix shared across partitions is
    # counted once per partition, shorter than the key depth
    extra = got.stats.multi_level_prefill_tokens - want.stats.multi_level_prefill_tokens
    assert 0 <= extra <= (max(got.depths) - 1) * got.partitions
    assert got.partitions > 1 and got.over_budget == 0
    assert plan_bytes(*got.largest_partition) <= budget
    if name in ("case1", "natural-qa"):
        assert max(got.depths) > FIRST_DEPTH
    assert not (tmp_path / "spill").exists()  # the work files go


def test_a_prefix_shorter_than_the_key_is_what_the_split_loses(tmp_path: Path) -> None:
    """Rows sharing only their first 2 tokens land in different partitions: in memory they
    form one group sharing those 2 tokens; in partitions, one group per partition. The loss
    is bounded by FIRST_DEPTH - 1 tokens per row, and every row is planned exactly once, in
    Eq. 4 order."""
    rng = np.random.default_rng(0)
    seqs = [np.r_[5, 6, rng.integers(10, 1000, size=int(rng.integers(4, 20)))] for _ in range(400)]
    p = TokenizedPrompts.from_lists(seqs, max_tokens=rng.integers(1, 50, size=400))
    want = build_plan(p)
    got = plan_spilled(spill_of(p, tmp_path, 16, batch=64), 1 << 30, tmp_path / "plan.parquet")
    plan = read_plan(tmp_path / "plan.parquet")
    assert want.num_groups <= 2 < plan.num_groups
    lost = got.stats.single_level_prefill_tokens - want.stats.single_level_prefill_tokens
    assert 0 < lost <= (FIRST_DEPTH - 1) * len(p)
    assert np.array_equal(np.sort(plan.members), np.arange(len(p)))
    assert np.array_equal(plan.row_ids, p.row_ids[plan.members])
    assert np.array_equal(plan.decode_estimate, p.max_tokens[plan.members])
    # the order is Eq. 4's over all the partitions' groups
    ordered = np.argsort(plan.members[plan.group_offsets[:-1]], kind="stable")
    sizes = np.diff(plan.group_offsets)
    off = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes[ordered], out=off[1:])
    members = np.concatenate([plan.group_members(g) for g in ordered])
    perm = group_order(plan.group_prefix_len[ordered], off, members, p.lengths, p.max_tokens)
    assert np.array_equal(ordered[perm], np.arange(plan.num_groups))


def test_a_partition_no_key_splits_is_planned_whole(tmp_path: Path) -> None:
    """Rows identical in their first 512+ tokens cannot be split by a key: planned as one
    partition over the budget, still correctly."""
    seqs = [np.r_[np.arange(600) % 900 + 1, [1000 + i]] for i in range(30)]
    p = TokenizedPrompts.from_lists(seqs)
    got = plan_spilled(spill_of(p, tmp_path, 4), 10_000, tmp_path / "plan.parquet")
    assert got.over_budget == 1 and got.partitions == 1
    assert got.stats == build_plan(p).stats


def test_counts_give_numpys_percentiles() -> None:
    rng = np.random.default_rng(1)
    x = np.r_[rng.integers(0, 50, size=999), [5_000_000]]
    c = Counts()
    c.add(x[:300])
    c.add(x[300:])
    assert c.dist() == pytest.approx(_dist(x))
    assert c.dist(lo=2) == pytest.approx(_dist(x[x >= 2]))
    assert Counts().dist() == _dist(np.zeros(0))
