"""Jobs on a real local Ray cluster (2 CPUs, 1-CPU engine workers, a tiny CPU model).

- 2 workers give the results of 1 worker and of a single-process run, row for row;
- a worker SIGKILLed after its first part file: the job still ends with one row per input
  row, equal to the undisturbed run, its unwritten rows rerun elsewhere;
- every worker killed: exit 1 (runtime failure), written rows kept, a rerun resumes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import load_job
from batchjob.errors import EXIT_CONFIG, EXIT_RUNTIME
from batchjob.outputs.naming import OutputLayout
from batchjob.runner.pipeline import JobResult, run
from tests.e2e.jobkit import cli, read_results, write_job

pytestmark = pytest.mark.usefixtures("ray_cluster")

SAMPLING = {"sampling.ignore_eos": "true"}  # every row decodes its max_tokens


def cluster_job(tmp: Path, model: Path, data: Path, out: str, workers: int, **cluster: str):
    job = write_job(tmp, model, data, out, flush_rows="2")
    sets = {**SAMPLING, "cluster.address": "local", "cluster.workers": str(workers), **cluster}
    if workers == 0:
        sets = dict(SAMPLING)
    return job, sets


def run_job(job: Path, sets: dict[str, str], heartbeat_s: float | None = None) -> JobResult:
    return run(load_job(job, sets), progress=False, heartbeat_s=heartbeat_s)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster_model: Path, cluster_data: Path) -> pa.Table:
    """The single-process run's results."""
    tmp = tmp_path_factory.mktemp("reference")
    job, sets = cluster_job(tmp, cluster_model, cluster_data, "single", 0)
    return read_results(run_job(job, sets).results_path)


def check_exactly_once(results: pa.Table, reference: pa.Table) -> None:
    ids = results["row_id"].to_pylist()
    assert len(ids) == len(set(ids)) == reference.num_rows
    assert results.equals(reference)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_give_the_single_process_results(
    tmp_path: Path,
    cluster_model: Path,
    cluster_data: Path,
    reference: pa.Table,
    workers: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job, sets = cluster_job(tmp_path, cluster_model, cluster_data, "out", workers)
    result = run_job(job, sets, heartbeat_s=0.2)
    assert "batchjob: cluster: " in capsys.readouterr().err  # the operator's log while it runs
    assert result.summary is not None and result.summary.device == f"ray:{workers}xcpu"
    check_exactly_once(read_results(result.results_path), reference)
    meta = OutputLayout.of(load_job(job, sets).output).meta
    assert not (meta / "workers").exists()  # removed at the end


class Killer:
    """Kills each named writer's process once that writer has a part file on disk."""

    def __init__(self, meta: Path, writers: list[str]):
        self.meta, self.pending, self.killed = meta, list(writers), []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while self.pending and not self.stop.is_set():
            for w in list(self.pending):
                info = self.meta / "workers" / f"{w}.json"
                if any((self.meta / "parts").glob(f"part-*-{w}.parquet")) and info.exists():
                    os.kill(json.loads(info.read_text())["pid"], signal.SIGKILL)
                    self.killed.append(w)
                    self.pending.remove(w)
            time.sleep(0.005)

    def __enter__(self) -> Killer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_killed_worker_rows_rerun_exactly_once(
    tmp_path: Path,
    cluster_model: Path,
    cluster_data: Path,
    reference: pa.Table,
    caplog: pytest.LogCaptureFixture,
) -> None:
    job, sets = cluster_job(tmp_path, cluster_model, cluster_data, "out", 2)
    meta = OutputLayout.of(load_job(job, sets).output).meta
    caplog.set_level(logging.INFO, logger="batchjob.runner.cluster.driver")
    with Killer(meta, ["w0"]) as killer:
        result = run_job(job, sets)
    assert killer.killed == ["w0"]
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and "rows left by shard" in died[0], died  # killed mid-shard
    check_exactly_once(read_results(result.results_path), reference)


def test_all_workers_dead_exit_1_then_resume(
    tmp_path: Path, cluster_model: Path, cluster_data: Path, reference: pa.Table
) -> None:
    job, sets = cluster_job(
        tmp_path, cluster_model, cluster_data, "out", 2, **{"cluster.max_restarts": "0"}
    )
    meta = OutputLayout.of(load_job(job, sets).output).meta
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    with Killer(meta, ["w0", "w1"]) as killer:
        failed = cli("run", job, *args)
    assert sorted(killer.killed) == ["w0", "w1"]
    assert failed.exit_code == EXIT_RUNTIME, failed.output
    assert "every cluster worker died" in failed.stderr and "rerun the job" in failed.stderr
    parts = {f.name: pq.read_table(f)["row_id"].to_pylist() for f in (meta / "parts").glob("p*")}
    assert {n.split("-")[-1] for n in parts} >= {"w0.parquet", "w1.parquet"}, parts
    written = sum(map(len, parts.values()))  # both wrote before dying; nothing committed yet
    assert not load_job(job, sets).output.path.exists()

    # same job on one worker ([cluster] is not in the manifest): resumes from the parts
    resumed = run_job(job, {**sets, "cluster.workers": "1"})
    assert resumed.summary is not None and resumed.summary.rows_skipped_done == written, parts
    check_exactly_once(read_results(resumed.results_path), reference)


def test_a_worker_error_keeps_its_exit_code(
    tmp_path: Path, cluster_model: Path, cluster_data: Path
) -> None:
    """A documented error raised in a worker (here: no row fits the KV budget, exit 3)
    reaches the user as one line with its own exit code, not as Ray's traceback."""
    job, sets = cluster_job(tmp_path, cluster_model, cluster_data, "out", 1)
    sets["engine.kv_cache_bytes"] = "1KiB"
    res = cli("run", job, *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    assert res.exit_code == EXIT_CONFIG, res.output
    assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr, res.stderr


def test_driver_failing_at_commit_reruns_no_row(
    tmp_path: Path,
    cluster_model: Path,
    cluster_data: Path,
    reference: pa.Table,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver fails after every worker wrote its rows (disk full at the commit): the
    rerun finds every row in the parts, starts no worker and commits them."""
    job, sets = cluster_job(tmp_path, cluster_model, cluster_data, "out", 2)
    monkeypatch.setenv("BATCHJOB_FAULT_POINT", "commit:1:ENOSPC")
    with pytest.raises(OSError):
        run_job(job, sets)
    monkeypatch.delenv("BATCHJOB_FAULT_POINT")
    again = run_job(job, sets)
    assert again.summary is not None and again.summary.device == "ray:2xnone"
    assert again.summary.rows_skipped_done == reference.num_rows
    check_exactly_once(read_results(again.results_path), reference)
