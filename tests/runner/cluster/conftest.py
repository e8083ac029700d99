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


def write_cluster_data(path: Path, scale: float, seed: int, max_tokens: tuple[int, int]) -> Path:
    """case1 as text at ``scale``, each row's ``max_tokens`` drawn from the range (both ends
    in), so rows finish (and parts are written) over many iterations, not all at once."""
    table = make_workload("case1", scale=scale, len_scale=0.05, seed=seed, form="text")
    rng = np.random.default_rng(seed)
    mt = pa.array(rng.integers(max_tokens[0], max_tokens[1] + 1, len(table)).astype(np.int32))
    table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens", mt)
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="session")
def cluster_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 rows in ~22 groups sharing long prefixes; 4-40 output tokens per row."""
    path = tmp_path_factory.mktemp("cluster-data") / "prompts.parquet"
    return write_cluster_data(path, scale=0.05, seed=5, max_tokens=(4, 40))
