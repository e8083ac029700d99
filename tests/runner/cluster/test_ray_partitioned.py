"""A job over ``scheduler.plan_memory`` on a real local Ray cluster: the workers read, spill,
plan and run the partitions (``batchjob.runner.cluster.partitioned``).

- 4 workers give the single-process partitioned run's results, file for file and row for
  row, and every worker planned some of the partitions;
- a worker SIGKILLed after its first part file: its partition runs again elsewhere, rows it
  wrote kept, every row once;
- the driver SIGKILLed mid-run (its workers with it), then rerun: the rerun skips every row
  written and ends with the same results, exactly once;
- `batchjob plan` on the cluster writes the plan file of the single-process plan's groups.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import load_job
from batchjob.inputs.source import open_input
from batchjob.outputs.naming import OutputLayout
from batchjob.runner.cluster import partitioned
from batchjob.runner.pipeline import run
from tests.e2e.jobkit import ROOT, cli, write_job
from tests.runner.cluster.conftest import write_cluster_data
from tests.runner.cluster.test_ray_cluster import Killer

pytestmark = pytest.mark.usefixtures("ray_cluster")

# ~450 short rows sharing their first tokens: one first-split partition, split again on a
# worker into a dozen or so, queued by cost over the workers
SETS = {"sampling.ignore_eos": "true", "scheduler.plan_memory": "48KiB"}
FOUR = {"cluster.address": "local", "cluster.workers": "4", "cluster.num_cpus": "0.5"}
OUTPUT = {"rows_per_file": "100", "flush_rows": "8"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("partitioned-data") / "prompts.parquet"
    write_cluster_data(path, scale=0.15, seed=11, max_tokens=(2, 6))
    t = pq.read_table(path)
    prompts = t.column("prompt").to_pylist()
    prompts[7] = "  "  # rejected: empty_prompt
    t = t.set_column(t.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    pq.write_table(t, path, row_group_size=64)  # row groups: one input slice per worker
    return path


def _files(folder: Path) -> list[pa.Table]:
    return [pq.read_table(f) for f in sorted(folder.glob("results-*.parquet"))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster_model: Path, data: Path) -> list[pa.Table]:
    """The single-process partitioned run's results files."""
    tmp = tmp_path_factory.mktemp("partitioned-reference")
    job = write_job(tmp, cluster_model, data, tmp / "single", **OUTPUT)
    result = run(load_job(job, SETS), progress=False)
    assert result.summary is not None
    return _files(Path(result.results_path))


def check_same_files(folder: Path, reference: list[pa.Table]) -> None:
    got = _files(folder)
    ids = [i for t in got for i in t["row_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == sum(t.num_rows for t in reference)  # exactly once
    assert len(got) == len(reference)
    for a, b in zip(reference, got, strict=True):
        assert a.equals(b)


def test_four_workers_plan_and_run_their_partitions_as_one_process(
    tmp_path: Path,
    cluster_model: Path,
    data: Path,
    reference: list[pa.Table],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="batchjob.runner.cluster.partitioned")
    opened: list[str] = []

    def counted_open(inp, *args, **kwargs):
        opened.append(inp.path)
        return open_input(inp, *args, **kwargs)

    monkeypatch.setattr(partitioned, "open_input", counted_open)
    job = write_job(tmp_path, cluster_model, data, tmp_path / "out", **OUTPUT)
    result = run(load_job(job, {**SETS, **FOUR}), progress=False)
    assert result.summary is not None and result.summary.device == "ray:4xcpu"
    check_same_files(tmp_path / "out", reference)  # pass-through columns included
    assert opened == [str(data)]  # the driver opened the input once: the commit reads none
    messages = [r.getMessage() for r in caplog.records]
    assert any("split into" in m for m in messages), messages  # a worker split the partition
    [per_worker] = [m for m in messages if "planning per worker" in m]
    assert all(f"w{i} " in per_worker for i in range(4)), per_worker  # every worker planned
    plan = pq.read_table(tmp_path / "out.meta" / "plan.parquet")
    assert sorted(plan["row_id"].to_pylist()) == sorted(
        i
        for t in reference
        for i, s in zip(t["row_id"].to_pylist(), t["status"].to_pylist(), strict=True)
        if s != "empty_prompt"
    )  # the plan file lists every row that ran, once
    meta = tmp_path / "out.meta"
    assert not list(meta.glob(".plan-spill-*")) and not (meta / "workers").exists()


def test_a_killed_worker_partition_runs_again_exactly_once(
    tmp_path: Path,
    cluster_model: Path,
    data: Path,
    reference: list[pa.Table],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="batchjob.runner.cluster.partitioned")
    job = write_job(tmp_path, cluster_model, data, tmp_path / "out", **OUTPUT)
    with Killer(tmp_path / "out.meta", ["w1"]) as killer:
        run(load_job(job, {**SETS, **FOUR}), progress=False)
    assert killer.killed == ["w1"]
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and "run again" in died[0], died
    check_same_files(tmp_path / "out", reference)


def test_a_killed_driver_resumes_exactly_once(
    tmp_path: Path, cluster_model: Path, data: Path, reference: list[pa.Table]
) -> None:
    job = write_job(tmp_path, cluster_model, data, tmp_path / "out", **OUTPUT)
    sets = {**SETS, **FOUR}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "batchjob.cli", "run", "--no-progress", str(job), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    parts = tmp_path / "out.meta" / "parts"
    deadline = time.monotonic() + 300
    try:  # killed once the workers have written a few parts
        while len(list(parts.glob("part-*-w*.parquet"))) < 3 and proc.poll() is None:
            assert time.monotonic() < deadline, "no parts written"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()
    time.sleep(4)  # the dead driver's Ray (its reaper ends it), workers included
    written = sum(pq.read_metadata(p).num_rows for p in parts.glob("part-*.parquet"))
    assert written > 0

    r = cli("run", job, *args, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["rows_skipped_done"] == written
    check_same_files(tmp_path / "out", reference)
    assert not list((tmp_path / "out.meta").glob(".plan-spill-*"))


def test_plan_on_the_cluster_is_the_single_process_plan(
    tmp_path: Path, cluster_model: Path, data: Path
) -> None:
    job = write_job(tmp_path, cluster_model, data, tmp_path / "out", **OUTPUT)
    sets = {**SETS, **FOUR}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    here = cli("plan", job, *args, "--json", "--plan-out", tmp_path / "cluster.parquet")
    assert here.exit_code == 0, here.output
    one = cli(
        "plan",
        job,
        *[a for k, v in SETS.items() for a in ("--set", f"{k}={v}")],
        "--json",
        "--plan-out",
        tmp_path / "single.parquet",
    )
    assert one.exit_code == 0, one.output
    a, b = json.loads(here.stdout), json.loads(one.stdout)
    assert a["num_requests"] == b["num_requests"] and a["rejected"] == b["rejected"]
    assert abs(a["saving_ratio_single_level"] - b["saving_ratio_single_level"]) < 0.005
    layout = OutputLayout.of(load_job(job, SETS).output)
    assert not list(Path(layout.meta).glob(".plan-spill-*"))
    plan = pq.read_table(tmp_path / "cluster.parquet")
    assert sorted(plan["row_id"].to_pylist()) == sorted(
        pq.read_table(tmp_path / "single.parquet")["row_id"].to_pylist()
    )
