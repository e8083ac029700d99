"""jobs/airflow_dag.py in a real Airflow: `airflow dags test` from .venv-airflow, SQLite metadata.

Airflow runs in its own venv (``make test-integration`` creates it with
.ci/setup_airflow_venv.sh) and calls the batchjob CLI of this venv on a tiny model.
What the DAG must do: plan then run; the output path templated by the run date; the second
run of a date a no-op; retries on exit 1 only. Task states and tries are read from Airflow's
own metadata database.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.e2e.jobkit import ROOT, build_dataset, build_model, read_results, write_job

AIRFLOW_VENV = Path(os.environ.get("BATCHJOB_AIRFLOW_VENV", ROOT / ".venv-airflow"))
AIRFLOW = AIRFLOW_VENV / "bin" / "airflow"
BATCHJOB = ROOT / ".venv" / "bin" / "batchjob"
DAG_ID = "batchjob_snippets"


@dataclass(frozen=True)
class Setup:
    home: Path  # AIRFLOW_HOME (SQLite metadata DB, logs)
    inputs: Path  # <inputs>/<ds>/data.parquet
    outputs: Path  # the DAG writes <outputs>/<ds>/
    job: Path
    env: dict[str, str]


@dataclass(frozen=True)
class DagRun:
    rc: int
    run_id: str
    log: str


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    if not AIRFLOW.exists():
        why = f"no Airflow at {AIRFLOW}: `make test-integration` creates .venv-airflow"
        if os.environ.get("BATCHJOB_REQUIRE_AIRFLOW"):  # make test-integration: never skip
            pytest.fail(why)
        pytest.skip(why)
    if not BATCHJOB.exists():
        pytest.fail(f"no batchjob CLI at {BATCHJOB} (make install)")
    tmp = tmp_path_factory.mktemp("airflow")
    home, dags, inputs, outputs = (tmp / d for d in ("home", "dags", "in", "out"))
    dags.mkdir()
    (dags / "airflow_dag.py").symlink_to(ROOT / "jobs" / "airflow_dag.py")
    model = build_model(tmp / "model")
    # the job's own input/output paths are placeholders: the DAG sets both per date
    job = write_job(tmp, model, inputs / "unused", outputs / "unused")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW_VAR_BATCHJOB_BIN": str(BATCHJOB),
        "AIRFLOW_VAR_BATCHJOB_JOB": str(job),
        "AIRFLOW_VAR_BATCHJOB_INPUT_ROOT": str(inputs),
        "AIRFLOW_VAR_BATCHJOB_OUTPUT_ROOT": str(outputs),
        "BATCHJOB_RETRY_DELAY_S": "1",
    }
    env.pop("BATCHJOB_FAULT_POINT", None)
    migrate = subprocess.run(
        [AIRFLOW, "db", "migrate"], env=env, capture_output=True, text=True, timeout=300
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
    return Setup(home, inputs, outputs, job, env)


def add_partition(s: Setup, ds: str, seed: int) -> Path:
    return build_dataset(s.inputs / ds / "data.parquet", seed=seed)


def dags_test(s: Setup, ds: str, **env: str) -> DagRun:
    """``airflow dags test batchjob_snippets <ds>`` -> exit code, run id and the whole log."""
    proc = subprocess.run(
        [AIRFLOW, "dags", "test", DAG_ID, ds],
        env={**s.env, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    found = re.search(r"DagRun Finished: .*?run_id=([^,]+),", proc.stdout)
    assert found, proc.stdout[-4000:]
    return DagRun(proc.returncode, found.group(1), proc.stdout)


def tries(s: Setup, run: DagRun) -> dict[str, tuple[str, int]]:
    """task_id -> (final state, tries made), from Airflow's metadata DB."""
    with sqlite3.connect(s.home / "airflow.db") as db:
        rows = db.execute(
            "SELECT task_id, state, try_number FROM task_instance WHERE dag_id = ? AND run_id = ?",
            (DAG_ID, run.run_id),
        ).fetchall()
    return {task: (state, n) for task, state, n in rows}


def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """name -> (mtime_ns, size) of the results folder and the manifest."""
    files = [*out.iterdir(), out.parent / f"{out.name}.meta" / "manifest.json"]
    return {f.name: (f.stat().st_mtime_ns, f.stat().st_size) for f in files}


def assert_one_row_per_input(out: Path, data: Path) -> None:
    results, rows = read_results(out), pq.read_table(data)
    assert results.column("row_id").to_pylist() == list(range(rows.num_rows))
    assert results.column("request_id").to_pylist() == rows.column("request_id").to_pylist()
    assert (out / "_SUCCESS").exists()


@pytest.fixture(scope="module")
def first(setup: Setup) -> tuple[DagRun, Path, Path]:
    """The first run of 2024-03-01 -> (run, its input, its output folder)."""
    data = add_partition(setup, "2024-03-01", seed=3)
    return dags_test(setup, "2024-03-01"), data, setup.outputs / "2024-03-01"


def test_plan_then_run_writes_the_dates_output(
    setup: Setup, first: tuple[DagRun, Path, Path]
) -> None:
    run, data, out = first
    assert run.rc == 0, run.log[-4000:]
    assert tries(setup, run) == {"plan": ("success", 1), "run": ("success", 1)}
    assert "batchjob plan" in run.log and "batchjob run" in run.log
    assert_one_row_per_input(out, data)


def test_second_run_of_a_date_is_a_noop(setup: Setup, first: tuple[DagRun, Path, Path]) -> None:
    run, data, out = first
    before = snapshot(out)
    manifest = (out.parent / f"{out.name}.meta" / "manifest.json").read_bytes()
    second = dags_test(setup, "2024-03-01")
    assert second.rc == 0, second.log[-4000:]
    assert second.run_id != run.run_id
    assert tries(setup, second) == {"plan": ("success", 1), "run": ("success", 1)}
    assert "already complete" in second.log
    assert snapshot(out) == before  # nothing rewritten
    assert (out.parent / f"{out.name}.meta" / "manifest.json").read_bytes() == manifest
    assert_one_row_per_input(out, data)


def test_another_date_gets_its_own_output(setup: Setup, first: tuple[DagRun, Path, Path]) -> None:
    _, _, out = first
    before = snapshot(out)
    data = add_partition(setup, "2024-03-02", seed=4)
    run = dags_test(setup, "2024-03-02")
    assert run.rc == 0, run.log[-4000:]
    assert_one_row_per_input(setup.outputs / "2024-03-02", data)
    assert snapshot(out) == before
    ids = read_results(setup.outputs / "2024-03-02").column("request_id").to_pylist()
    assert ids != read_results(out).column("request_id").to_pylist()


def test_exit_other_than_1_fails_the_run_task_without_retry(
    setup: Setup, first: tuple[DagRun, Path, Path]
) -> None:
    """The run task exits 3 (the output holds another job's results): failed on try 1."""
    _, data, out = first
    before = snapshot(out)
    other_job = setup.job.with_name("other.toml")  # max_tokens differs: another manifest
    other_job.write_text(setup.job.read_text().replace("max_tokens = 6", "max_tokens = 5"))
    failed = dags_test(setup, "2024-03-01", AIRFLOW_VAR_BATCHJOB_JOB=str(other_job))
    assert failed.rc != 0
    assert tries(setup, failed) == {"plan": ("success", 1), "run": ("failed", 1)}
    assert "Command exited with return code 3" in failed.log
    assert "sampling.max_tokens differs" in failed.log
    assert snapshot(out) == before  # the first job's results untouched
    assert_one_row_per_input(out, data)


def test_exit_1_is_retried(setup: Setup) -> None:
    """A disk error while writing results (exit 1) is retried, here once; both tries fail."""
    ds = "2024-05-01"
    add_partition(setup, ds, seed=6)
    # the injected fault stays set, so the retry fails at its first part file too
    failed = dags_test(setup, ds, BATCHJOB_FAULT_POINT="part:1:EIO", BATCHJOB_RETRIES="1")
    assert failed.rc != 0
    assert tries(setup, failed) == {"plan": ("success", 1), "run": ("failed", 2)}
    assert failed.log.count("Command exited with return code 1") == 2
    assert not (setup.outputs / ds).exists()
