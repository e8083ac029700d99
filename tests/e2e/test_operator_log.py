"""The operator's log. With no terminal (cron, Airflow) a run prints a progress
line every N seconds on stderr; before, nothing was printed until the end."""

from __future__ import annotations

import io
import re

from batchjob.runner.heartbeat import Heartbeat, interval_from_env
from tests.e2e.jobkit import cli_subprocess, write_job

LINE = re.compile(
    r"batchjob: rows (\d+)/(\d+) \(\d+\.\d%\), [\d.]+ rows/s, \d+ tok/s, ETA \S+, KV \S+"
)


def test_heartbeat_lines_on_a_pipe(tmp_path, run_model, run_data):
    job = write_job(tmp_path, run_model, run_data, "out/results.parquet")
    res = cli_subprocess(
        "run", job, "--set", "scheduler.chunk_size=8", env={"BATCHJOB_HEARTBEAT_S": "0.05"}
    )
    assert res.returncode == 0, res.stderr
    beats = [LINE.search(x) for x in res.stderr.splitlines()]
    beats = [b for b in beats if b]
    assert len(beats) >= 2, res.stderr
    done = [int(b.group(1)) for b in beats]
    assert done == sorted(done) and all(int(b.group(2)) == int(beats[0].group(2)) for b in beats)
    assert "to run" in res.stderr.splitlines()[0]  # the start line: what this run will do


def test_heartbeat_rate_limit_and_eta():
    t = [0.0]
    out = io.StringIO()
    hb = Heartbeat(total_rows=100, every_s=30, stream=out, clock=lambda: t[0])
    for step in range(1, 11):
        t[0] = step * 10.0  # 10 s per call: a line every 3rd call
        hb.beat(rows_done=step * 5, tokens=step * 500, kv_bytes=2**29, kv_budget=2**30)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0] == (
        "batchjob: rows 15/100 (15.0%), 0.5 rows/s, 50 tok/s, ETA 2m50s, KV 50% of 1.0 GiB"
    )


def test_interval_from_env(monkeypatch):
    monkeypatch.delenv("BATCHJOB_HEARTBEAT_S", raising=False)
    assert interval_from_env() == 30.0
    monkeypatch.setenv("BATCHJOB_HEARTBEAT_S", "0")
    assert interval_from_env() is None
    monkeypatch.setenv("BATCHJOB_HEARTBEAT_S", "2.5")
    assert interval_from_env() == 2.5
