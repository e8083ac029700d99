"""`batchjob run` over scheduler.plan_memory for the jobs whose rows carry more than their
tokens: per-row setting columns, sampling.n (and input.n_column), scoring labels and per-row
LoRA adapters. Each runs partition by partition and its results equal the in-memory run's
file for file, row for row; a run of samples killed mid-way resumes exactly once."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import load_job
from batchjob.runner.pipeline import run as run_job
from batchjob.testing.lora_adapter import make_lora_adapter
from batchjob.testing.workloads import make_workload
from tests.e2e.jobkit import ROOT

BUDGET = "64KiB"  # ~600 short rows: dozens of partitions
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kinds")
    t = make_workload("case1", scale=0.2, len_scale=0.05, seed=7, form="text", max_tokens=2)
    n = t.num_rows
    rng = np.random.default_rng(5)
    temp = rng.uniform(0.2, 1.5, n)
    temp_col = pa.array([None if i % 7 == 0 else float(v) for i, v in enumerate(temp)])
    temp_list = temp_col.to_pylist()
    temp_list[13] = 5.0  # rejected: invalid_temperature
    seeds = pa.array([None if i % 5 == 0 else int(i * 31) for i in range(n)], pa.int64())
    samples = pa.array([None if i % 4 == 0 else 1 + i % 3 for i in range(n)], pa.int64())
    labels = [None if i % 3 else [" kima", " babu", " rana"] for i in range(n)]
    adapter = [("a", "b", None, "a")[i % 4] for i in range(n)]
    adapter[17] = "zzz"  # rejected: invalid_adapter
    prompts = t.column("prompt").to_pylist()
    prompts[11] = "  "  # rejected: empty_prompt
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    t = t.append_column("temperature", pa.array(temp_list, pa.float64()))
    t = t.append_column("seed", seeds).append_column("samples", samples)
    t = t.append_column("labels", pa.array(labels, pa.list_(pa.string())))
    t = t.append_column("adapter", pa.array(adapter, pa.string()))
    path = d / "prompts.parquet"
    pq.write_table(t, path, row_group_size=128)
    return path


@pytest.fixture(scope="module")
def adapters(run_model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("adapters")
    made = {n: make_lora_adapter(root / n, run_model, seed=i) for i, n in enumerate("ab")}
    return "{" + ", ".join(f'{k} = "{v}"' for k, v in made.items()) + "}"


KINDS = {
    "row_settings": {
        "input.temperature_column": "temperature",
        "input.seed_column": "seed",
        "sampling.seed": "3",
    },
    "samples": {"sampling.n": "2", "sampling.temperature": "0.8", "sampling.seed": "1"},
    "n_column": {"input.n_column": "samples", "sampling.temperature": "0.8"},
    "labels": {"sampling.labels": '[" yes", " no"]', "input.labels_column": "labels"},
    "adapters": {"input.adapter_column": "adapter"},
}


def _sets(model: Path, data: Path, out: Path, kind: str, adapters: str) -> dict[str, str]:
    sets = {
        "input.path": str(data),
        "input.batch_rows": "100",
        "model.path": str(model),
        "model.device": "cpu",
        "sampling.max_tokens": "2",
        "scheduler.chunk_size": "64",
        "engine.kv_cache_bytes": "8MiB",
        "engine.threads": "1",
        "output.path": str(out),
        "output.rows_per_file": "250",
        "output.flush_rows": "100",
    }
    if kind == "adapters":
        sets["model.adapters"] = adapters
    return sets | KINDS[kind]


def _assert_same(a: pa.Table, b: pa.Table) -> None:
    """Equal, but for label log-probs within float32 rounding: a row scored beside other
    rows (another partition's plan, another batch) sums its logits in another order."""
    if "label_logprobs" not in a.column_names:
        assert a.equals(b)
        return
    rest = [c for c in a.column_names if c != "label_logprobs"]
    assert a.select(rest).equals(b.select(rest))
    for x, y in zip(a["label_logprobs"].to_pylist(), b["label_logprobs"].to_pylist(), strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def _files(folder: Path) -> list[pa.Table]:
    return [pq.read_table(f) for f in sorted(folder.glob("results-*.parquet"))]


@pytest.mark.parametrize("kind", list(KINDS))
def test_partitioned_run_equals_the_in_memory_run(
    tmp_path: Path, run_model: Path, data: Path, adapters: str, kind: str, caplog
) -> None:
    ref = run_job(load_job(None, _sets(run_model, data, tmp_path / "ref", kind, adapters)))
    sets = _sets(run_model, data, tmp_path / "part", kind, adapters)
    with caplog.at_level(logging.INFO, logger="batchjob.runner.run_stream"):
        got = run_job(load_job(None, sets | {"scheduler.plan_memory": BUDGET}))
    assert "running in" in caplog.text and "partitions" in caplog.text
    assert got.summary is not None and ref.summary is not None
    assert (tmp_path / "part.meta").is_dir()
    want, have = _files(tmp_path / "ref"), _files(tmp_path / "part")
    assert len(want) == len(have) > 1
    for a, b in zip(want, have, strict=True):
        _assert_same(a, b)
    whole = pa.concat_tables(have)
    assert got.summary.rows_total == ref.summary.rows_total == whole.num_rows
    assert got.summary.rows_rejected == ref.summary.rows_rejected
    statuses = set(whole["status"].to_pylist())
    assert "ok" in statuses and "empty_prompt" in statuses
    if kind == "row_settings":
        assert "invalid_temperature" in statuses
    if kind == "adapters":
        assert "invalid_adapter" in statuses
    if kind in ("samples", "n_column"):
        assert whole.num_rows > 600
    report = json.loads((tmp_path / "part.meta" / "report.json").read_text())
    assert report["rows_total"] == whole.num_rows


def test_partitioned_samples_killed_and_resumed_exactly_once(
    tmp_path: Path, run_model: Path, data: Path, adapters: str
) -> None:
    ref_dir, out = tmp_path / "ref", tmp_path / "part"
    run_job(load_job(None, _sets(run_model, data, ref_dir, "n_column", adapters)))
    sets = _sets(run_model, data, out, "n_column", adapters) | {"scheduler.plan_memory": BUDGET}
    cmd = [sys.executable, "-m", "batchjob.cli", "run", "--no-progress"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), BATCHJOB_FAULT_POINT="part:4")
    killed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    parts = sorted((tmp_path / "part.meta" / "parts").glob("part-*.parquet"))
    written = sum(pq.read_metadata(p).num_rows for p in parts)
    assert written > 0 and not out.exists()
    env.pop("BATCHJOB_FAULT_POINT")
    again = subprocess.run(
        [*cmd, "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    want = _files(ref_dir)
    total = sum(t.num_rows for t in want)
    assert summary["rows_skipped_done"] == written
    assert summary["requests_run"] + written == total
    have = _files(out)
    assert len(have) == len(want)
    for a, b in zip(want, have, strict=True):
        _assert_same(a, b)


def test_a_file_without_a_setting_column_runs_as_in_memory(
    tmp_path: Path, run_model: Path, data: Path, adapters: str
) -> None:
    """Two input files, the second without the setting columns (and with a column of its
    own): its rows take the job's settings and the other file's columns as nulls, planned in
    memory or in partitions alike (batches are read with the dataset's unified columns)."""
    folder = tmp_path / "in"
    folder.mkdir()
    t = pq.read_table(data)
    half = t.num_rows // 2
    pq.write_table(t.slice(0, half), folder / "a.parquet", row_group_size=128)
    b = t.slice(half).drop_columns(["temperature", "seed"])
    b = b.append_column("note", pa.array([f"n{i}" for i in range(b.num_rows)]))
    pq.write_table(b, folder / "b.parquet", row_group_size=128)
    sets = {"input.path": str(folder)}
    ref = run_job(
        load_job(None, _sets(run_model, data, tmp_path / "ref", "row_settings", "") | sets)
    )
    got = run_job(
        load_job(
            None,
            _sets(run_model, data, tmp_path / "part", "row_settings", "")
            | sets
            | {"scheduler.plan_memory": BUDGET},
        )
    )
    assert got.summary is not None and ref.summary is not None
    want, have = _files(tmp_path / "ref"), _files(tmp_path / "part")
    assert len(want) == len(have) > 1
    for x, y in zip(want, have, strict=True):
        assert x.equals(y)
    whole = pa.concat_tables(have)
    assert whole.num_rows == t.num_rows
    late = whole.filter(pa.compute.greater_equal(whole["row_id"], half))
    assert late["temperature"].null_count == late.num_rows  # the file had none
    assert whole.filter(pa.compute.less(whole["row_id"], half))["note"].null_count == half
