"""Fault injection: SIGKILL a small job at named points (and at seeded random times), rerun,
and check exactly-once results equal to an uninterrupted run, with no temp files left.

Named points (``storage.faults``): before a part file is written (``part``), after the job's
manifest (``manifest``), after each final file is staged (``stage``), at the start of the
commit (``commit``), between the final files moved into place (``commit_file``), after the
commit's manifest (``committed``), before the report (``report``) and between renaming the
parts away and deleting them (``cleanup``). Killed runs are subprocesses; reruns run in this
process (no start-up cost).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.e2e.jobkit import ROOT, build_dataset, cli, write_job

SEED = 20261123
COLS = ["row_id", "output_token_ids", "num_output_tokens", "finish_reason", "status", "request_id"]
_rng = random.Random(SEED)
# (label, [fault specs applied one after another, each a killed run]) - the same on every run
KILLS: list[tuple[str, list[str]]] = [
    ("first part", ["part:1"]),
    ("mid run", [f"part:{_rng.randint(2, 5)}"]),
    ("last parts", [f"part:{_rng.randint(6, 8)}"]),
    ("after manifest", ["manifest:1"]),
    ("staging 1st file", ["stage:1"]),
    ("staging later file", [f"stage:{_rng.randint(2, 3)}"]),
    ("commit start", ["commit:1"]),
    ("inside final write", ["commit_file:1"]),
    ("inside final write, later", [f"commit_file:{_rng.randint(2, 3)}"]),
    ("after commit", ["committed:1"]),
    ("before report", ["report:1"]),
    ("during cleanup", ["cleanup:1"]),
    ("three in a row", ["part:2", "stage:2", "cleanup:1"]),
    ("timed", [f"timed:{_rng.uniform(0.5, 4.0):.2f}"]),
    ("timed twice", [f"timed:{_rng.uniform(0.5, 3.0):.2f}", f"timed:{_rng.uniform(2.0, 5.0):.2f}"]),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, run_model):
    d = tmp_path_factory.mktemp("fi")
    data = build_dataset(d / "prompts.parquet", seed=5, scale=0.008)
    ref_job = write_job(d, run_model, data, d / "ref", rows_per_file="5")
    res = cli("run", ref_job)
    assert res.exit_code == 0, res.output
    return run_model, data, pq.read_table(d / "ref").sort_by("row_id").select(COLS)


def _killed_run(job: Path, spec: str) -> int:
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress"]
    cmd += ["--set", "scheduler.chunk_size=16"]  # many iterations: parts land one by one
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    name, _, arg = spec.partition(":")
    if name != "timed":
        env["BATCHJOB_FAULT_POINT"] = spec
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    if name == "timed":
        try:
            proc.wait(timeout=float(arg))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode


@pytest.mark.parametrize("label,specs", KILLS, ids=[k[0] for k in KILLS])
def test_killed_job_reruns_to_the_same_results(tmp_path, setup, label, specs):
    model, data, expected = setup
    out = tmp_path / "out"
    job = write_job(tmp_path, model, data, out, rows_per_file="5", flush_rows="2")
    codes = [_killed_run(job, spec) for spec in specs]
    assert -signal.SIGKILL in codes or label.startswith("timed")  # the point was reached
    res = cli("run", job)
    assert res.exit_code == 0, res.output
    got = pq.read_table(out).sort_by("row_id").select(COLS)
    assert got["row_id"].to_pylist() == list(range(expected.num_rows))  # once each
    assert got.equals(expected), label
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "_SUCCESS" and all(n.startswith("results-") for n in names[1:])
    meta = tmp_path / "out.meta"
    assert sorted(p.name for p in meta.iterdir() if not p.name.startswith("report")) == [
        "lock",
        "manifest.json",
        "plan.parquet",
    ]
    assert (meta / "report.json").is_file()
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp") or ".trash" in p.name]
    assert not leftovers, leftovers
    again = cli("run", job)
    assert again.exit_code == 0 and "already complete" in again.output
    assert pa.concat_tables([got]).num_rows == expected.num_rows
