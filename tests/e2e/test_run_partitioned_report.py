"""`batchjob run` over scheduler.plan_memory: the report's iteration records and the rejected
rows come from their spill files (``batchjob.outputs.spilled_records``), whole and in order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from batchjob.testing.workloads import make_workload
from tests.e2e.jobkit import cli, write_job

pytestmark = pytest.mark.slow


def test_partitioned_report_holds_every_iteration_and_rejected_row(
    tmp_path: Path, run_model: Path
) -> None:
    t = make_workload("case1", scale=0.3, len_scale=0.05, seed=3, form="text", max_tokens=2)
    prompts = t.column("prompt").to_pylist()
    bad = [5, 77, 150]
    for i in bad:
        prompts[i] = "  "  # rejected: empty_prompt
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    data = tmp_path / "prompts.parquet"
    pq.write_table(t, data)
    out = tmp_path / "part"
    job = write_job(tmp_path, run_model, data, out, rows_per_file="200")
    r = cli("run", job, "--set", "scheduler.plan_memory=64KiB", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    meta = tmp_path / "part.meta"
    its = pq.read_table(meta / "report.iterations.parquet")
    # numbered on across the partitions: one record per engine iteration of the job
    assert its.num_rows == summary["iterations"] > 0
    assert np.array_equal(its["iteration"].to_numpy(), np.arange(its.num_rows))
    tokens = its["decode_tokens"].to_numpy() + its["prefill_tokens"].to_numpy()
    assert np.isclose(tokens.mean(), summary["mean_tokens_per_iteration"])
    assert int(tokens.min()) == summary["min_tokens_per_iteration"]
    assert 0 < summary["tecd_s"] <= its["wall_s"].to_numpy().sum() + 1e-9
    assert summary["rows_rejected"] == len(bad)
    res = pa.concat_tables(pq.read_table(f) for f in sorted(out.glob("results-*.parquet")))
    assert res.num_rows == t.num_rows
    rejected = res.filter(pc.equal(res["status"], "empty_prompt"))
    assert rejected["row_id"].to_pylist() == bad
    assert not list(meta.glob(".iterations-*")) and not list(meta.glob(".plan-spill-*"))
