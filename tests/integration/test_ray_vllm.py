"""The cluster on the vLLM backend (CPU build): 2 Ray workers, each an in-process vLLM engine,
give the native single-process results row for row. About a minute (two vLLM start-ups), so
it runs with ``make test-integration`` rather than ``make test`` (tests/runner/cluster covers the
cluster itself on the native backend there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchjob.runner.pipeline import run
from tests.backends.vllm.vllm_kit import (
    RESULT_COLUMNS,
    build_dataset,
    build_model,
    job_for,
    needs_vllm,
)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@needs_vllm
def test_two_vllm_workers_equal_native(tmp_path: Path, local_ray: None) -> None:
    model = build_model(tmp_path / "tiny")
    data = build_dataset(tmp_path / "prompts.parquet")
    native = run(job_for(model, data, tmp_path / "native", "native"), progress=False)
    cluster = {"cluster.address": "local", "cluster.workers": "2"}
    res = run(job_for(model, data, tmp_path / "vllm", "vllm", **cluster), progress=False)
    assert res.summary is not None and res.summary.device == "ray:2xcpu"
    want = pq.read_table(native.results_path).select(RESULT_COLUMNS).to_pylist()
    got = pq.read_table(res.results_path).select(RESULT_COLUMNS).to_pylist()
    assert len(got) == len(want) > 0 and got == want
