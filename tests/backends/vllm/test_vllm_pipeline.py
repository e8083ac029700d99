"""``batchjob run`` with ``engine.backend = "vllm"``: CLI, Parquet in/out, report, stop
strings, kill -9 and resume, and vLLM failures as clear errors with exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from batchjob.config import load_job
from batchjob.errors import EXIT_CONFIG
from batchjob.outputs.naming import OutputLayout
from tests.backends.vllm.vllm_kit import (
    RESULT_COLUMNS,
    native_results,
    needs_vllm,
)
from tests.signals import signal_after_parts

pytestmark = [needs_vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]


def write_job(tmp: Path, model: Path, data: Path, out: str, backend: str, **extra: str) -> Path:
    sections = {
        "input": {"path": f'"{data}"'},
        "model": {"path": f'"{model}"'},
        "sampling": {"max_tokens": "8"},
        "scheduler": {"chunk_size": "256"},
        "engine": {
            "backend": f'"{backend}"',
            "block_size": "32",
            "kv_cache_bytes": '"2MiB"',
            "threads": "1",
        },
        "output": {"path": f'"{tmp / out}"'},
    }
    if backend == "vllm":
        sections["engine"]["vllm"] = "{enforce_eager = true}"
    for dotted, value in extra.items():
        section, _, key = dotted.partition("__")
        sections[section][key] = value
    lines = [
        f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) for s, kv in sections.items()
    ]
    job = tmp / f"{out.replace('/', '_')}.toml"
    job.write_text("".join(lines))
    return job


def results(path: Path) -> list[dict]:
    return pq.read_table(path).select(RESULT_COLUMNS).to_pylist()


def test_cli_run_with_stop_strings_equals_native(tmp_path, model_dir, dataset):
    # a stop string that some outputs contain and others do not
    plain = native_results(model_dir, dataset, tmp_path / "plain.parquet")
    texts = [r["output_text"] for r in plain]
    grams = Counter(g for t in texts for g in {t[i : i + 3] for i in range(len(t) - 2)})
    stop = min(grams, key=lambda g: (abs(grams[g] - len(texts) / 2), g))
    extra = {"sampling__stop": json.dumps([stop])}

    native_job = write_job(tmp_path, model_dir, dataset, "n/r.parquet", "native", **extra)
    vllm_job = write_job(tmp_path, model_dir, dataset, "v/r.parquet", "vllm", **extra)
    assert CliRunner().invoke(main, ["run", str(native_job)]).exit_code == 0
    res = CliRunner().invoke(main, ["run", str(vllm_job)])
    assert res.exit_code == 0, res.output
    expected, got = results(tmp_path / "n/r.parquet"), results(tmp_path / "v/r.parquet")
    assert got == expected  # token ids, finish reasons, texts cut at the stop string
    reasons = Counter(r["finish_reason"] for r in got)
    assert reasons["stop"] > 0 and reasons["length"] > 0
    assert all(stop not in r["output_text"] for r in got)

    meta = OutputLayout.of(load_job(vllm_job).output).meta
    summary = json.loads((meta / "report.json").read_text())
    assert summary["device"] == "cpu" and summary["rows_total"] == len(expected)
    assert summary["iterations"] > 1 and summary["preemptions"] == 0
    assert 0 < summary["saving_ratio_achieved"] <= summary["saving_ratio_planned"]
    iters = pq.read_table(meta / "report.iterations.parquet")
    assert sum(iters["prefill_tokens"].to_pylist()) == summary["computed_prefill_tokens"]
    assert (meta / "report.timeline.png").stat().st_size > 1000


def test_kill_9_mid_run_then_rerun_gives_one_row_per_input(tmp_path, model_dir, dataset):
    # vLLM's own scheduler with 2 sequences at a time: hundreds of steps, rows finish one by one
    slow = {
        "scheduler__policy": '"baseline"',
        "scheduler__max_num_seqs": "2",
        "sampling__max_tokens": "24",
        "sampling__ignore_eos": "true",
        "output__flush_rows": "1",
    }
    ref = write_job(tmp_path, model_dir, dataset, "ref/r.parquet", "native", **slow)
    assert CliRunner().invoke(main, ["run", str(ref)]).exit_code == 0
    expected = pq.read_table(tmp_path / "ref/r.parquet")

    job = write_job(tmp_path, model_dir, dataset, "run/r.parquet", "vllm", **slow)
    parts = OutputLayout.of(load_job(job).output).parts
    code, _ = signal_after_parts(job, parts, 3, sig=signal.SIGKILL, timeout=240)
    assert code == -signal.SIGKILL, "the run ended before it could be killed"
    written = pa.concat_tables([pq.read_table(p) for p in parts.glob("part-*.parquet")])
    assert 0 < written.num_rows < expected.num_rows

    res = CliRunner().invoke(main, ["run", str(job)])
    assert res.exit_code == 0, res.output
    meta = OutputLayout.of(load_job(job).output).meta
    summary = json.loads((meta / "report.json").read_text())
    assert summary["rows_skipped_done"] == written.num_rows
    resumed = pq.read_table(tmp_path / "run/r.parquet")
    assert resumed["row_id"].to_pylist() == list(range(expected.num_rows))
    cols = ["row_id", "output_token_ids", "status", "finish_reason", "request_id"]
    assert resumed.select(cols).to_pylist() == expected.select(cols).to_pylist()


def test_bad_engine_argument_is_a_config_error_not_a_hang(tmp_path, model_dir, dataset):
    job = write_job(
        tmp_path,
        model_dir,
        dataset,
        "bad/r.parquet",
        "vllm",
        engine__vllm='{quantization = "nope"}',
    )
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(job), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-2000:]
    assert "engine.vllm" in proc.stderr and "quantization" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_kv_budget_below_the_longest_request_names_the_row(tmp_path, model_dir, dataset):
    job = write_job(
        tmp_path, model_dir, dataset, "small/r.parquet", "vllm", engine__kv_cache_bytes='"64KiB"'
    )
    res = CliRunner().invoke(main, ["run", str(job)])
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "engine.kv_cache_bytes" in res.output and "row_id" in res.output


def test_row_over_the_kv_budget_gets_a_status_and_the_rest_runs_as_on_native(tmp_path, model_dir):
    """The Backend contract's rule on both backends: a request that cannot fit the KV cache
    even alone is reported as ``kv_budget_exceeded`` and every other row runs (on vLLM it
    used to stop the job with a config error)."""
    from batchjob.testing.workloads import WORDS

    short = [" ".join(WORDS[i : i + 5]) for i in range(0, 15, 5)]
    data = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"prompt": [*short[:2], " ".join(WORDS[100:400]), short[2]]}), data)
    # 256 KiB: 8 blocks of 32 tokens of this model (1 KiB a token); 300 words need more alone
    budget = {"engine__kv_cache_bytes": '"256KiB"'}
    statuses = {}
    for backend in ("native", "vllm"):
        job = write_job(tmp_path, model_dir, data, f"{backend}/r.parquet", backend, **budget)
        res = CliRunner().invoke(main, ["run", str(job)])
        assert res.exit_code == 0, res.output
        out = pq.read_table(tmp_path / backend / "r.parquet").sort_by("row_id").to_pylist()
        assert [r["row_id"] for r in out] == [0, 1, 2, 3]
        assert "engine.kv_cache_bytes" in out[2]["message"]
        assert all(r["num_output_tokens"] > 0 for r in out if r["status"] == "ok")
        assert "4 rows: 3 ok, 1 rejected" in res.stdout
        statuses[backend] = [r["status"] for r in out]
    assert statuses["vllm"] == statuses["native"] == ["ok", "ok", "kv_budget_exceeded", "ok"]
