"""A real local Ray cluster for the session (2 CPUs: two 1-CPU workers), a tiny model and a
dataset long enough that a worker can be killed in the middle of its shard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.testing.workloads import make_workload
from tests.e2e.jobkit import build_model

ray = pytest.importorskip("ray")  # a guard only: `make install` installs Ray


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def cluster_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("cluster-model") / "tiny")


@pytest.fixture(scope="session")
def cluster_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """case1 as text: 150 rows in ~22 groups sharing long prefixes; 4-40 output tokens per
    row, so rows finish (and parts are written) over many iterations, not all at once."""
    table = make_workload("case1", scale=0.05, len_scale=0.05, seed=5, form="text")
    rng = np.random.default_rng(5)
    mt = pa.array(rng.integers(4, 41, len(table)).astype(np.int32))
    table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens", mt)
    path = tmp_path_factory.mktemp("cluster-data") / "prompts.parquet"
    pq.write_table(table, path)
    return path
