"""Reading and tokenizing a cluster job's input as Ray tasks over its row groups
(``batchjob.runner.cluster.read``) gives exactly what one process reads: the same prompts, per-row
settings, rejected rows (status and message) and pass-through columns, and a job's results
equal the single-process run's row for row. Real local Ray cluster (tests/runner/cluster/conftest).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import InputConfig, load_job
from batchjob.inputs.source import open_input
from batchjob.runner.cluster.read import Fragment, fragments, group, load_prompts_on_cluster
from batchjob.runner.pipeline import run
from batchjob.testing.workloads import make_workload
from batchjob.tokenize.batched import load_prompts
from tests.e2e.jobkit import read_results, write_job

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def split_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 files x row groups of 16 rows (90 text rows), some bad: null / blank prompts,
    max_tokens 0, a prompt longer than the context, an invalid per-row temperature."""
    table = make_workload("case1", scale=0.03, len_scale=0.05, seed=7, form="text")[:90]
    prompts = table["prompt"].to_pylist()
    prompts[3], prompts[40], prompts[71] = None, "   ", " ".join(["alpha"] * 3000)
    mt = np.random.default_rng(7).integers(1, 5, len(table)).astype(np.int32)
    mt[17] = mt[58] = 0
    temp = [0.0] * len(table)
    temp[33] = -1.0  # invalid_temperature, found by the row settings after the merge
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    table = table.set_column(table.schema.get_field_index("max_tokens"), "max_tokens", pa.array(mt))
    table = table.append_column("temp", pa.array(temp))
    folder = tmp_path_factory.mktemp("split-data")
    for i, (a, b) in enumerate([(0, 30), (30, 65), (65, 90)]):
        pq.write_table(table[a:b], folder / f"part-{i}.parquet", row_group_size=16)
    return folder


def job_file(tmp: Path, model: Path, data: Path, out: str, workers: int | None):
    job = write_job(tmp, model, data, out, flush_rows="4")
    sets = {"sampling.ignore_eos": "true", "input.temperature_column": '"temp"'}
    if workers:
        sets |= {"cluster.address": "local", "cluster.workers": str(workers)}
    return load_job(job, sets)


def test_groups_are_consecutive_and_balanced() -> None:
    frags = [Fragment("f", i, 10 * i, 10 * i, n) for i, n in enumerate([10, 10, 10, 10, 50])]
    groups = group(frags, 2)
    assert [f for g in groups for f in g] == frags
    assert [sum(f.num_rows for f in g) for g in groups] == [40, 50]
    assert len(group(frags[:1], 4)) == 1 and group([], 2) == []


def test_fragments_follow_row_groups_and_limit(split_data: Path) -> None:
    frags = fragments(open_input(InputConfig(path=str(split_data))))
    assert [(f.row_start, f.file_row, f.num_rows) for f in frags] == [
        (0, 0, 16), (16, 16, 14), (30, 0, 16), (46, 16, 16), (62, 32, 3), (65, 0, 16), (81, 16, 9)
    ]  # fmt: skip
    cut = fragments(open_input(InputConfig(path=str(split_data), limit=50)))
    assert [(f.row_start, f.num_rows) for f in cut] == [(0, 16), (16, 14), (30, 16), (46, 4)]


def test_tasks_read_what_one_process_reads(
    tmp_path: Path,
    cluster_model: Path,
    split_data: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = job_file(tmp_path, cluster_model, split_data, "a", None)
    single, _ = load_prompts(job.input, job.model, job.sampling, "native")
    caplog.set_level(logging.INFO, logger="batchjob.runner.cluster.read")
    job = job_file(tmp_path, cluster_model, split_data, "b", 2)
    tasks, _ = load_prompts_on_cluster(job)
    said = [r.getMessage() for r in caplog.records if "Ray tasks" in r.getMessage()]
    assert len(said) == 1 and re.search(r"90 rows, 7 fragments in 2 Ray tasks", said[0]), said

    a, b = single.prompts, tasks.prompts
    for f in ("row_ids", "tokens", "offsets", "max_tokens"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.settings is not None and b.settings is not None
    assert np.array_equal(a.settings.row_ids, b.settings.row_ids)
    assert np.array_equal(a.settings.temperature, b.settings.temperature)
    assert single.rejected.counts() == {
        "empty_prompt": 2,
        "invalid_max_tokens": 2,
        "prompt_too_long": 1,
        "invalid_temperature": 1,
    }
    assert np.array_equal(single.rejected.row_ids, tasks.rejected.row_ids)
    assert single.rejected.status == tasks.rejected.status
    assert single.rejected.message == tasks.rejected.message  # file and row named the same
    assert single.passthrough.equals(tasks.passthrough)


def test_cluster_job_on_split_input_equals_single_process(
    tmp_path: Path, cluster_model: Path, split_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ref = run(job_file(tmp_path, cluster_model, split_data, "one", None), progress=False)
    caplog.set_level(logging.INFO, logger="batchjob.runner.cluster.read")
    out = run(job_file(tmp_path, cluster_model, split_data, "two", 2), progress=False)
    assert any("in 2 Ray tasks" in r.getMessage() for r in caplog.records)
    expected, got = read_results(ref.results_path), read_results(out.results_path)
    assert got.num_rows == 90 and got.equals(expected)
    assert sorted(set(got["status"].to_pylist())) == [
        "empty_prompt",
        "invalid_max_tokens",
        "invalid_temperature",
        "ok",
        "prompt_too_long",
    ]


def test_tasks_build_prompts_from_a_template_as_one_process_does(
    tmp_path: Path, cluster_model: Path, split_data: Path
) -> None:
    """A template input: each Ray task rebuilds the prompt builder, so the tokens are the
    templated prompts one process reads (not the raw column)."""
    tpl = {"input.template": '"Question: {prompt}\\nAnswer:"'}
    single_job = load_job(write_job(tmp_path, cluster_model, split_data, "t1"), tpl)
    single, _ = load_prompts(single_job.input, single_job.model, single_job.sampling, "native")
    plain_job = load_job(write_job(tmp_path, cluster_model, split_data, "t0"))
    plain, _ = load_prompts(plain_job.input, plain_job.model, plain_job.sampling, "native")
    cluster = {"cluster.address": "local", "cluster.workers": "2"}
    job = load_job(write_job(tmp_path, cluster_model, split_data, "t2"), tpl | cluster)
    tasks, _ = load_prompts_on_cluster(job)
    assert len(single.prompts.tokens) > len(plain.prompts.tokens)  # the template applied
    for f in ("row_ids", "tokens", "offsets"):
        assert np.array_equal(getattr(single.prompts, f), getattr(tasks.prompts, f)), f
