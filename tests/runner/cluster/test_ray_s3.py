"""A cluster job on an object store: input and output on a real S3-compatible server (moto,
tests/storage/test_s3.py's fixture), its row groups read by 2 Ray tasks from there, 2 Ray workers
writing their parts there, committed once."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchjob.storage.stores import ObjectPath
from tests.e2e.jobkit import cli, read_results, write_job

pytest.importorskip("moto.server", reason="moto[server] (dev extra) not installed")
from tests.storage.test_s3 import BUCKET, _keys, s3  # noqa: F401  (s3: the server fixture)

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_two_workers_on_s3_equal_local(
    s3,  # noqa: F811
    tmp_path: Path,
    cluster_model: Path,
    cluster_data: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = pq.read_table(cluster_data)
    pq.write_table(table, f"{BUCKET}/cluster-in/prompts.parquet", filesystem=s3, row_group_size=50)
    local = write_job(tmp_path, cluster_model, cluster_data, "local")
    assert cli("run", "--no-progress", local).exit_code == 0
    out = f"s3://{BUCKET}/cluster-out/day1"
    sets = {
        "input.path": f"s3://{BUCKET}/cluster-in/",
        "output.path": out,
        "cluster.address": "local",
        "cluster.workers": "2",
        "output.flush_rows": "16",
    }
    caplog.set_level(logging.INFO, logger="batchjob.runner.cluster.read")
    res = cli(
        "run", "--no-progress", local, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    )
    assert res.exit_code == 0, res.output
    assert any("3 fragments in 2 Ray tasks" in r.getMessage() for r in caplog.records)
    got = pq.read_table(ObjectPath(out).key, filesystem=s3).sort_by("row_id")
    assert got.equals(read_results(tmp_path / "local"))
    names = _keys(s3, "cluster-out/day1")
    assert names[0] == "_SUCCESS" and len(names) == 2 and names[1].startswith("results-00000-")
    assert not [k for k in _keys(s3, "cluster-out/day1.meta") if k.startswith("parts/")]
