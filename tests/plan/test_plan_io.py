"""Plan <-> Parquet round trip, atomic writes, malformed files."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import InputDataError
from batchjob.plan import build_plan
from batchjob.plan.plan import Plan
from batchjob.plan.plan_io import read_plan, write_plan
from batchjob.tokenize.prompts import TokenizedPrompts


def make_plan(seed: int = 0, n: int = 40) -> Plan:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 20, 12).tolist() for _ in range(5)]
    seqs = [docs[rng.integers(0, 5)] + rng.integers(0, 20, 3).tolist() for _ in range(n)]
    prompts = TokenizedPrompts.from_lists(
        seqs, row_ids=rng.permutation(n) * 7, max_tokens=rng.integers(1, 300, n)
    )
    return build_plan(prompts)


def assert_same(a: Plan, b: Plan) -> None:
    for name in ("group_prefix_len", "group_offsets", "members", "row_ids", "decode_estimate"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert asdict(a.stats) == asdict(b.stats)


def test_round_trip(tmp_path):
    plan = make_plan()
    assert plan.num_groups > 1 and (plan.group_prefix_len > 0).any()
    path = tmp_path / "plan.parquet"
    write_plan(plan, path)
    assert_same(read_plan(path), plan)
    table = pq.read_table(path)
    assert table.column_names == ["group", "row_id", "position", "prefix_len", "decode_estimate"]
    assert table.num_rows == len(plan.members)


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "plan.parquet"
    write_plan(make_plan(0), path)
    second = make_plan(1, n=25)
    write_plan(second, path)
    assert_same(read_plan(path), second)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.parquet"]


def test_failed_write_keeps_old_file(tmp_path):
    path = tmp_path / "plan.parquet"
    first = make_plan(0)
    write_plan(first, path)
    bad = Plan(  # row_ids too short: pyarrow refuses to build the table
        group_prefix_len=first.group_prefix_len,
        group_offsets=first.group_offsets,
        members=first.members,
        row_ids=first.row_ids[:-1],
        decode_estimate=first.decode_estimate,
        stats=first.stats,
    )
    with pytest.raises(pa.ArrowInvalid):
        write_plan(bad, path)
    assert_same(read_plan(path), first)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.parquet"]


def test_empty_plan_round_trip(tmp_path):
    plan = build_plan(TokenizedPrompts.from_lists([]))
    write_plan(plan, tmp_path / "p.parquet")
    assert_same(read_plan(tmp_path / "p.parquet"), plan)


def test_malformed_files(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(InputDataError, match=r"junk\.parquet"):
        read_plan(junk)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), other)
    with pytest.raises(InputDataError, match="missing"):
        read_plan(other)
    path = tmp_path / "gap.parquet"
    write_plan(make_plan(), path)
    table = pq.read_table(path)
    group = table.column("group").to_numpy().copy()
    group[group == group.max()] += 1  # skip a group index
    pq.write_table(table.set_column(0, "group", pa.array(group)), path)
    with pytest.raises(InputDataError, match="group"):
        read_plan(path)
