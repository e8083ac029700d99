"""`batchjob run` over scheduler.plan_memory: planned and run partition by partition,
committed a results file at a time; the same results as the in-memory run, and a run killed
mid-way resumes with every row written exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.testing.workloads import make_workload
from tests.e2e.jobkit import cli, killed_run, write_job

BUDGET = "scheduler.plan_memory=64KiB"  # ~2,000 short rows: dozens of partitions
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, run_model: Path):
    d = tmp_path_factory.mktemp("part-run")
    t = make_workload("case1", scale=0.6, len_scale=0.05, seed=7, form="text", max_tokens=2)
    prompts = t.column("prompt").to_pylist()
    prompts[11] = "  "  # rejected: empty_prompt
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    data = d / "prompts.parquet"
    pq.write_table(t, data)
    ref = write_job(d, run_model, data, d / "ref", rows_per_file="400", flush_rows="100")
    r = cli("run", ref)
    assert r.exit_code == 0, r.output
    return d, run_model, data


def _files(folder: Path) -> list[pa.Table]:
    return [pq.read_table(f) for f in sorted(folder.glob("results-*.parquet"))]


def test_partitioned_run_killed_and_resumed_equals_the_in_memory_run(setup) -> None:
    d, model, data = setup
    out = d / "part"
    job = write_job(d, model, data, out, rows_per_file="400", flush_rows="100")
    killed = killed_run(job, "--set", BUDGET, spec="part:6", timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    meta = d / "part.meta"
    parts = sorted((meta / "parts").glob("part-*.parquet"))
    written = sum(pq.read_metadata(p).num_rows for p in parts)
    assert len(parts) == 5 and 0 < written < 1000
    assert list(meta.glob(".plan-spill-*"))  # SIGKILL: the spill stays until the next start
    assert not out.exists()

    r = cli("run", job, "--set", BUDGET, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    ref = _files(d / "ref")
    total = sum(t.num_rows for t in ref)
    # exactly once: every row written by one run or the other (the rejected one by the first)
    assert summary["rows_skipped_done"] == written
    assert summary["requests_run"] + written == total
    got = _files(out)
    assert len(got) == len(ref) == -(-total // 400)  # the same files, row for row
    for a, b in zip(ref, got, strict=True):
        assert a.equals(b)
    assert not list(meta.glob(".plan-spill-*")) and not list(meta.glob(".commit-buckets-*"))
    assert not (meta / "parts").exists()
    assert "already complete" in cli("run", job, "--set", BUDGET).output


def test_partitioned_run_to_one_file(setup) -> None:
    d, model, data = setup
    job = write_job(d, model, data, d / "one.parquet")
    r = cli("run", job, "--set", BUDGET, "--set", "output.rows_per_file=300")
    assert r.exit_code == 0, r.output
    got = pq.read_table(d / "one.parquet")
    assert pq.ParquetFile(d / "one.parquet").num_row_groups == -(-got.num_rows // 300)
    assert got.equals(pa.concat_tables(_files(d / "ref")))
