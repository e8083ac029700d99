"""Per-row checks that gave a wrong status or message, and token-id input
that needed a tokenizer it does not use."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from tests.e2e.jobkit import cli, read_results, write_job


def test_token_ids_need_no_tokenizer_json(tmp_path, run_model):
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for f in run_model.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, model / f.name)
    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"prompt": pa.array([[5, 6, 7], [8, 9]], pa.list_(pa.int32()))}), data)
    res = cli("run", write_job(tmp_path, model, data, "o/r.parquet"))
    assert res.exit_code == 0, res.output
    out = read_results(tmp_path / "o" / "r.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "ok"]
    assert all(r["output_token_ids"] and r["output_text"] is None for r in out)


def test_row_statuses_and_messages(tmp_path, run_model):
    ids = pa.array([[5, 6, 7], [8, None, 9], [4, 5], [4, 9999]], pa.list_(pa.int32()))
    mt = pa.array([2, 2, 2**40, 2], pa.int64())
    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"prompt": ids, "max_tokens": mt}), data)
    assert cli("run", write_job(tmp_path, run_model, data, "a/r.parquet")).exit_code == 0
    out = read_results(tmp_path / "a" / "r.parquet").to_pylist()
    want = ["ok", "invalid_tokens", "invalid_max_tokens", "invalid_tokens"]
    assert [r["status"] for r in out] == want
    assert "null token id" in out[1]["message"] and "outside" not in out[1]["message"]
    assert str(2**40) in out[2]["message"] and ">= 1" not in out[2]["message"]
    assert "outside [0, 2500)" in out[3]["message"]

    text = tmp_path / "ws.parquet"
    pq.write_table(pa.table({"prompt": ["alpha beta", "   ", "\n\t", None]}), text)
    assert cli("run", write_job(tmp_path, run_model, text, "b/r.parquet")).exit_code == 0
    out = read_results(tmp_path / "b" / "r.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok"] + ["empty_prompt"] * 3
    assert "whitespace" in out[1]["message"]


def test_huge_prompt_is_rejected_without_tokenizing(tmp_path, run_model):
    """An 8 MB prompt for a 4096-token model: prompt_too_long, said in bytes, at small memory
    (was 1.4 GB peak and 11 s: the whole string went through the tokenizer first)."""
    import subprocess
    import sys

    from tests.e2e.jobkit import ROOT

    big = "alpha beta gamma delta " * (8_000_000 // 23)
    data = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": ["alpha beta", big]}), data)
    job = write_job(tmp_path, run_model, data, "o/r.parquet")
    probe = (
        "import resource, subprocess, sys;"
        f"subprocess.run([sys.executable, '-m', 'batchjob.cli', 'run', {str(job)!r}], check=True,"
        " capture_output=True);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    peak_mib = int(res.stdout.strip()) / 1024
    out = read_results(tmp_path / "o" / "r.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "prompt_too_long"]
    assert "bytes" in out[1]["message"] and "not tokenized" in out[1]["message"]
    assert peak_mib < 700, peak_mib
