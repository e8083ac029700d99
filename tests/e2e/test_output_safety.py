"""Output safety: safe overwrite, job identity (manifest), the lock, the output layout.

Each test reproduces a way the tester lost data or got a wrong answer without an error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import EXIT_CONFIG, EXIT_LOCKED, EXIT_MODEL
from tests.e2e.jobkit import ROOT, build_dataset, cli, read_results, write_job
from tests.signals import signal_after_parts

# ---------------------------------------------------------------------------------------
# item 1: overwrite never deletes before the new results are complete


def test_output_equal_to_input_is_refused_and_input_kept(tmp_path, run_model, run_data):
    data = tmp_path / "in.parquet"
    data.write_bytes(run_data.read_bytes())
    job = write_job(tmp_path, run_model, data, data, overwrite="true")
    res = cli("run", job)
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "output.path" in res.stderr and "input" in res.stderr
    assert pq.read_table(data).num_rows == pq.read_table(run_data).num_rows  # input intact


def test_output_folder_holding_the_input_is_refused(tmp_path, run_model, run_data):
    folder = tmp_path / "both"
    folder.mkdir()
    data = folder / "in.parquet"
    data.write_bytes(run_data.read_bytes())
    res = cli("run", write_job(tmp_path, run_model, data, folder, overwrite="true"))
    assert res.exit_code == EXIT_CONFIG, res.output
    assert data.exists() and "output.path" in res.stderr


def test_failed_overwrite_run_keeps_previous_results_and_report(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    assert cli("run", job).exit_code == 0
    before = read_results(tmp_path / "out" / "results.parquet")
    report = tmp_path / "out" / "results.parquet.meta" / "report.json"
    report_before = report.read_text()

    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in run_model.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())  # tokenizer and config, no weights
    res = cli("run", job, "--model", broken, "--set", "output.overwrite=true")
    assert res.exit_code == EXIT_MODEL, res.output
    assert read_results(tmp_path / "out" / "results.parquet").equals(before)
    assert report.read_text() == report_before
    # and the kept results are still "this job's": a plain rerun says complete
    again = cli("run", job)
    assert again.exit_code == 0 and "already complete" in again.output


def test_successful_overwrite_replaces_results(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out")
    assert cli("run", job, "--set", "output.rows_per_file=5").exit_code == 0
    n_before = len(list((tmp_path / "out").glob("results-*.parquet")))
    res = cli("run", job, "--set", "output.overwrite=true", "--set", "input.limit=9")
    assert res.exit_code == 0, res.output
    out = read_results(tmp_path / "out")  # the whole folder: stale files would be read too
    assert out["row_id"].to_pylist() == list(range(9))
    assert len(list((tmp_path / "out").glob("results-*.parquet"))) < n_before


# ---------------------------------------------------------------------------------------
# item 2: resume and "already complete" require the same job


def _interrupted_run(tmp_path: Path, job: Path, parts: Path) -> None:
    """Start ``job`` in a subprocess and SIGINT it once 2 part files exist."""
    sets = ("--set", "scheduler.chunk_size=8", "--set", "output.flush_rows=1")
    code, err = signal_after_parts(job, parts, 2, extra=sets)
    assert code == 130, err


def test_resume_with_a_different_input_is_refused(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    _interrupted_run(tmp_path, job, tmp_path / "out" / "results.parquet.meta" / "parts")
    other = build_dataset(tmp_path / "other.parquet", seed=11)
    res = cli("run", job, "--input", other)
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "input.files" in res.stderr and "output.overwrite=true" in res.stderr
    assert not (tmp_path / "out" / "results.parquet").exists()
    # the same job resumes; a different one with overwrite starts over
    res = cli("run", job, "--input", other, "--set", "output.overwrite=true")
    assert res.exit_code == 0, res.output
    out = read_results(tmp_path / "out" / "results.parquet")
    assert out["request_id"].to_pylist() == pq.read_table(other)["request_id"].to_pylist()


def test_changed_sampling_is_a_different_job_but_threads_are_not(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    assert cli("run", job).exit_code == 0
    res = cli("run", job, "--set", "sampling.temperature=0.7")
    assert res.exit_code == EXIT_CONFIG and "sampling.temperature" in res.stderr
    same = cli("run", job, "--set", "engine.threads=2", "--set", "scheduler.chunk_size=32")
    assert same.exit_code == 0 and "already complete" in same.output


def test_unrelated_parquet_at_output_is_not_complete(tmp_path, run_model, run_data):
    out = tmp_path / "out" / "results.parquet"
    out.parent.mkdir()
    pq.write_table(pa.table({"x": [1, 2, 3]}), out)
    res = cli("run", write_job(tmp_path, run_model, run_data, out))
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "manifest" in res.stderr and "output.overwrite=true" in res.stderr
    assert pq.read_table(out).column_names == ["x"]  # left alone


# ---------------------------------------------------------------------------------------
# item 3: one run per output at a time


def test_second_run_on_the_same_output_exits_locked(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress"]
    cmd += ["--set", "scheduler.chunk_size=4", "--set", "output.flush_rows=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "out" / "results.parquet.meta" / "parts"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if parts.is_dir() and any(parts.glob("part-*.parquet")):
            break
        time.sleep(0.01)
    t0 = time.monotonic()
    second = cli("run", job)
    assert second.exit_code == EXIT_LOCKED, second.output
    assert time.monotonic() - t0 < 10 and "another batchjob run" in second.stderr
    assert "Traceback" not in second.output
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    out = read_results(tmp_path / "out" / "results.parquet")
    assert out["row_id"].to_pylist() == list(range(pq.read_metadata(run_data).num_rows))


# ---------------------------------------------------------------------------------------
# item 4: a results folder is a dataset


def test_directory_output_is_a_readable_dataset(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out", rows_per_file="7")
    assert cli("run", job).exit_code == 0
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "_SUCCESS" and all(n.startswith("results-") for n in names[1:])
    n = pq.read_metadata(run_data).num_rows
    assert pq.read_table(out).num_rows == n
    assert pl.scan_parquet(str(out) + "/*.parquet").collect().height == n
    meta = tmp_path / "out.meta"
    for name in ("report.json", "plan.parquet", "manifest.json"):
        assert (meta / name).is_file(), name
    assert not (meta / "parts").exists() and not (meta / "staging").exists()


def test_single_file_output_keeps_metadata_in_a_sibling_folder(tmp_path, run_model, run_data):
    assert cli("run", write_job(tmp_path, run_model, run_data, "o/results.parquet")).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "results.parquet",
        "results.parquet.meta",
    ]


@pytest.mark.parametrize("where", ["under_a_file", "in_a_dir_named_parquet"])
def test_unusable_output_path_is_a_config_error(tmp_path, run_model, run_data, where):
    if where == "under_a_file":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "results.parquet"
    else:
        out = tmp_path / "d.parquet"
        out.mkdir()
    res = cli("run", write_job(tmp_path, run_model, run_data, out))
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "output.path" in res.stderr and "Traceback" not in res.output


def test_output_matching_the_input_glob_is_refused_before_the_first_run(
    tmp_path, run_model, run_data
):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.parquet").write_bytes(run_data.read_bytes())
    job = write_job(tmp_path, run_model, Path(str(d / "*.parquet")), d / "results.parquet")
    res = cli("run", job)
    assert res.exit_code == EXIT_CONFIG and "input.path" in res.stderr, res.output
    assert not (d / "results.parquet").exists()


def test_plan_with_an_unusable_output_path_is_a_config_error(tmp_path, run_model, run_data):
    (tmp_path / "afile").write_text("x")
    job = write_job(tmp_path, run_model, run_data, tmp_path / "afile" / "r.parquet")
    res = cli("plan", job)
    assert res.exit_code == EXIT_CONFIG and "Traceback" not in res.output, res.output
    assert "output" in res.stderr
