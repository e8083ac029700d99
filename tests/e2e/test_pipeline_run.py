"""`batchjob run` end to end on a real tiny model and real Parquet files.

One result row per input row (rejected rows included), pass-through columns, report files,
idempotent reruns, directory output, and a Ctrl-C mid-job that loses and duplicates nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.errors import EXIT_INTERRUPTED
from batchjob.plan.intmath import cdiv
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.testing.workloads import WORDS, make_workload
from tests.signals import signal_after_parts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", vocab_size=2500, corpus=corpus)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    table = make_workload("case1", scale=0.01, len_scale=0.05, seed=3, form="text", max_tokens=6)
    prompts = table["prompt"].to_pylist()
    prompts[1] = ""  # a per-row problem: reported, not fatal
    prompts[4] = None
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(prompts))
    path = tmp_path_factory.mktemp("data") / "prompts.parquet"
    pq.write_table(table, path)
    return path


def write_job(tmp: Path, model: Path, data: Path, out: str, **extra: str) -> Path:
    lines = [
        "[input]",
        f'path = "{data}"',
        "[model]",
        f'path = "{model}"',
        'device = "cpu"',
        "[sampling]",
        "max_tokens = 6",
        "[scheduler]",
        "chunk_size = 64",
        "[engine]",
        'kv_cache_bytes = "8MiB"',
        "threads = 1",
        "[output]",
        f'path = "{tmp / out}"',
    ]
    lines += [f"{k} = {v}" for k, v in extra.items()]
    job = tmp / f"{out.replace('/', '_')}.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def test_run_writes_one_row_per_input_and_a_report(tmp_path, model_dir, dataset):
    job = write_job(tmp_path, model_dir, dataset, "out/results.parquet")
    res = CliRunner().invoke(main, ["run", str(job), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    inp = pq.read_table(dataset)
    out = pq.read_table(tmp_path / "out" / "results.parquet")
    assert out["row_id"].to_pylist() == list(range(inp.num_rows))
    assert out["request_id"].to_pylist() == inp["request_id"].to_pylist()  # pass-through
    status = out["status"].to_pylist()
    assert status[1] == "empty_prompt" and status[4] == "empty_prompt"
    assert status.count("ok") == inp.num_rows - 2
    ok = [r for r in out.to_pylist() if r["status"] == "ok"]
    assert all(r["num_output_tokens"] == 6 or r["finish_reason"] == "stop" for r in ok)
    assert all(r["output_text"] is not None for r in ok)
    assert summary["rows_total"] == inp.num_rows and summary["rows_rejected"] == 2
    assert summary["saving_ratio_achieved"] == pytest.approx(summary["saving_ratio_planned"])
    assert summary["saving_ratio_planned"] > 0.3
    meta = tmp_path / "out" / "results.parquet.meta"  # everything but results
    report = meta / "report.json"
    assert json.loads(report.read_text())["iterations"] > 1
    iters = pq.read_table(meta / "report.iterations.parquet")
    assert sum(iters["prefill_tokens"].to_pylist()) >= summary["computed_prefill_tokens"]
    assert (meta / "report.timeline.png").stat().st_size > 1000
    assert (meta / "plan.parquet").exists()

    again = CliRunner().invoke(main, ["run", str(job)])
    assert again.exit_code == 0 and "already complete" in again.output


def test_directory_output_split_by_rows_per_file(tmp_path, model_dir, dataset):
    job = write_job(tmp_path, model_dir, dataset, "outdir", rows_per_file="7")
    res = CliRunner().invoke(main, ["run", str(job)])
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / "outdir").glob("results-*.parquet"))
    n = pq.read_metadata(dataset).num_rows
    assert len(files) == cdiv(n, 7)
    ids = np.concatenate([pq.read_table(f)["row_id"].to_numpy() for f in files])
    assert ids.tolist() == list(range(n))
    assert (tmp_path / "outdir" / "_SUCCESS").exists()


def test_interrupted_job_resumes_without_loss_or_duplicates(tmp_path, model_dir, dataset):
    reference = write_job(tmp_path, model_dir, dataset, "ref/results.parquet")
    assert CliRunner().invoke(main, ["run", str(reference)]).exit_code == 0
    expected = pq.read_table(tmp_path / "ref" / "results.parquet")

    job = write_job(tmp_path, model_dir, dataset, "run/results.parquet", flush_rows="1")
    parts = tmp_path / "run" / "results.parquet.meta" / "parts"
    # chunk_size 8: many small iterations, rows finish one by one, so SIGINT lands mid-job
    # however fast the engine is (outputs do not depend on chunking)
    code, err = signal_after_parts(job, parts, 3, extra=("--set", "scheduler.chunk_size=8"))
    assert code == EXIT_INTERRUPTED, err
    written = pa.concat_tables([pq.read_table(p) for p in parts.glob("part-*.parquet")])
    n = expected.num_rows
    assert 0 < written.num_rows < n  # some rows were on disk, not all
    assert not (tmp_path / "run" / "results.parquet").exists()

    res = CliRunner().invoke(main, ["run", str(job), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rows_skipped_done"] == written.num_rows
    resumed = pq.read_table(tmp_path / "run" / "results.parquet")
    assert resumed["row_id"].to_pylist() == list(range(n))
    cols = ["row_id", "output_token_ids", "status", "finish_reason", "request_id"]
    assert resumed.select(cols).to_pylist() == expected.select(cols).to_pylist()


def test_kv_budget_too_small_is_a_config_error_naming_the_row(tmp_path, model_dir, dataset):
    job = write_job(tmp_path, model_dir, dataset, "small/results.parquet")
    for budget, words in (("4096", "too small"), ("20000", "row_id")):
        args = ["run", str(job), "--set", f"engine.kv_cache_bytes={budget}"]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 3, res.output
        assert "engine.kv_cache_bytes" in res.output and words in res.output
