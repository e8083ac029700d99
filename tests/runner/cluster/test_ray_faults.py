"""The kill/fault soak (tests/e2e/test_fault_injection.py) on Ray shards: a ``cluster.address
= "local"`` run with two engine workers, its driver SIGKILLed at each commit point and at a
seeded random time (workers mid-shard), then rerun: exactly one result row per input row,
equal to the single-process run. Killed workers: tests/runner/cluster/test_ray_cluster.py.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pyarrow as pa
import pytest

from batchjob.config import load_job
from batchjob.outputs.naming import OutputLayout
from tests.e2e.jobkit import killed_run, read_results
from tests.runner.cluster.conftest import write_cluster_data
from tests.runner.cluster.test_ray_cluster import check_exactly_once, cluster_job, run_job

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def soak_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 rows of 4-12 output tokens: parts land one by one, each killed run stays short."""
    path = tmp_path_factory.mktemp("soak-data") / "prompts.parquet"
    return write_cluster_data(path, scale=0.013, seed=7, max_tokens=(4, 12))


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
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    driver = killed_run(job, *args, spec=spec, group=True)  # with whatever of its Ray is left
    assert driver.returncode == -signal.SIGKILL or spec.startswith("timed"), driver.stderr
    again = run_job(job, sets)
    check_exactly_once(read_results(again.results_path), soak_reference)
    meta = OutputLayout.of(load_job(job, sets).output).meta
    assert not list((meta / "parts").glob("*.parquet")) if (meta / "parts").exists() else True
