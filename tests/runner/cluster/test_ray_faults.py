"""The kill/fault soak (tests/e2e/test_fault_injection.py) on Ray shards: a ``cluster.address
= "local"`` run with two engine workers, its driver SIGKILLed at each commit point and at a
seeded random time (workers mid-shard), then rerun: exactly one result row per input row,
equal to the single-process run. Killed workers: tests/runner/cluster/test_ray_cluster.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import load_job
from batchjob.outputs.naming import OutputLayout
from batchjob.testing.workloads import make_workload
from tests.e2e.jobkit import ROOT, read_results
from tests.runner.cluster.test_ray_cluster import check_exactly_once, cluster_job, run_job

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def soak_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 rows of 4-12 output tokens: parts land one by one, each killed run stays short."""
    table = make_workload("case1", scale=0.013, len_scale=0.05, seed=7, form="text")
    rng = np.random.default_rng(7)
    mt = pa.array(rng.integers(4, 13, len(table)).astype(np.int32))
    table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens", mt)
    path = tmp_path_factory.mktemp("soak-data") / "prompts.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def soak_reference(tmp_path_factory, cluster_model: Path, soak_data: Path) -> pa.Table:
    """The single-process run's results."""
    tmp = tmp_path_factory.mktemp("soak-reference")
    job, sets = cluster_job(tmp, cluster_model, soak_data, "single", 0)
    return read_results(run_job(job, sets).results_path)


_rng = random.Random(20261202)
RAY_KILLS = [
    "commit:1",
    "committed:1",
    "cleanup:1",
    f"timed:{_rng.uniform(6.0, 12.0):.1f}",
]


@pytest.mark.parametrize("spec", RAY_KILLS)
def test_ray_run_killed_at_each_point_reruns_exactly_once(
    tmp_path: Path, cluster_model: Path, soak_data: Path, soak_reference: pa.Table, spec: str
) -> None:
    job, sets = cluster_job(tmp_path, cluster_model, soak_data, "out", 2)
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress"]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    name, _, at = spec.partition(":")
    if name != "timed":
        env["BATCHJOB_FAULT_POINT"] = spec
    driver = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        try:
            _, err = driver.communicate(timeout=float(at) if name == "timed" else 300)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGKILL)
            _, err = driver.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)  # whatever of its Ray is left
    if name != "timed":
        assert driver.returncode == -signal.SIGKILL, err
    else:
        assert driver.returncode in (0, -signal.SIGKILL), err
    again = run_job(job, sets)
    check_exactly_once(read_results(again.results_path), soak_reference)
    meta = OutputLayout.of(load_job(job, sets).output).meta
    assert not list((meta / "parts").glob("*.parquet")) if (meta / "parts").exists() else True
