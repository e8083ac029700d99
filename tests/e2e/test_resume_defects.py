"""Resume and report completeness: resume and overwrite corner cases, file modes,
and a report that says which job it describes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq

from batchjob import __version__
from batchjob.errors import EXIT_CONFIG
from tests.e2e.jobkit import cli, read_results, write_job
from tests.signals import signal_after_parts


def _interrupt(job: Path, parts: Path, *sets: str) -> None:
    extra = ("--set", "scheduler.chunk_size=8", "--set", "output.flush_rows=1", *sets)
    code, err = signal_after_parts(job, parts, 3, extra=extra)
    assert code == 130, err


def test_resume_with_fewer_input_rows_is_exit_3_and_overwrite_recovers(
    tmp_path, run_model, run_data
):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    _interrupt(job, tmp_path / "out" / "results.parquet.meta" / "parts")
    for _ in range(2):  # every retry gives the same clear answer (was exit 1 each time)
        res = cli("run", job, "--set", "input.limit=5")
        assert res.exit_code == EXIT_CONFIG and "input.limit" in res.stderr, res.output
    res = cli("run", job, "--set", "input.limit=5", "--set", "output.overwrite=true")
    assert res.exit_code == 0, res.output
    assert read_results(tmp_path / "out" / "results.parquet")["row_id"].to_pylist() == list(
        range(5)
    )


def test_interrupted_overwrite_run_keeps_its_progress(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet", overwrite="true")
    assert cli("run", job).exit_code == 0
    _interrupt(job, tmp_path / "out" / "results.parquet.meta" / "parts")
    assert (tmp_path / "out" / "results.parquet").exists()  # the earlier results are intact
    res = cli("run", job, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rows_skipped_done"] >= 3  # the parts were resumed


def test_result_files_follow_the_umask(tmp_path, run_model, run_data):
    old = os.umask(0o022)
    try:
        job = write_job(tmp_path, run_model, run_data, "out", rows_per_file="10")
        assert cli("run", job).exit_code == 0
    finally:
        os.umask(old)
    for f in (tmp_path / "out").iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f
    assert (tmp_path / "out.meta" / "report.json").stat().st_mode & 0o777 == 0o644


def test_report_names_the_job_and_counts_the_whole_job_after_resume(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    _interrupt(job, tmp_path / "out" / "results.parquet.meta" / "parts")
    assert cli("run", job).exit_code == 0
    report = json.loads((tmp_path / "out" / "results.parquet.meta" / "report.json").read_text())
    ident = report["job"]
    assert ident["input.path"] == str(run_data) and ident["model.path"] == str(run_model)
    assert ident["batchjob_version"] == __version__ and ident["job_file"] == str(job)
    assert ident["config"]["sampling"]["max_tokens"] == 6
    assert ident["started_at"] <= ident["finished_at"]
    n = pq.read_metadata(run_data).num_rows
    assert sum(report["outcomes"].values()) == n  # whole job, not only the resumed segment
    assert report["rows_skipped_done"] > 0
