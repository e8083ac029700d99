"""Scores and per-row settings through ``batchjob run`` on a tiny model: log-probabilities in
the results, scoring mode (job labels and a per-row labels column, multi-token labels), per-row
sampling columns with per-row rejections, and the jobs/ranking_labels.toml example."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import EXIT_INPUT
from batchjob.testing.workloads import ranking_table
from batchjob.tokenize.tokenizer import load_tokenizer
from tests.e2e.jobkit import ROOT, cli, cli_subprocess, read_results, write_job


def run_ok(tmp: Path, model: Path, data: Path, name: str, lines: list[str]) -> pa.Table:
    job = write_job(tmp, model, data, name)
    text = job.read_text()
    for line in lines:  # "[section] key = value"
        section, _, kv = line.partition("] ")
        text = text.replace(f"{section}]\n", f"{section}]\n{kv}\n", 1)
    job.write_text(text)
    r = cli("run", job, "--no-progress")
    assert r.exit_code == 0, r.output + (r.stderr or "")
    return read_results(tmp / name)


def test_logprobs_columns(tmp_path, run_model, run_data):
    res = run_ok(tmp_path, run_model, run_data, "lp.parquet", ["[sampling] logprobs = 3"])
    assert "output_logprobs" in res.column_names and "label" not in res.column_names
    for row in res.to_pylist():
        steps = row["output_logprobs"]
        assert len(steps) == row["num_output_tokens"] == len(row["output_token_ids"])
        for s, tok in zip(steps, row["output_token_ids"], strict=True):
            assert s["token_id"] == tok and s["logprob"] <= 0
            assert len(s["top"]) == 3
            assert s["top"][0]["token_id"] == tok  # greedy: the chosen token is the top one
            assert s["top"][0]["logprob"] == pytest.approx(s["logprob"])
    plain = run_ok(tmp_path, run_model, run_data, "plain.parquet", [])
    assert "output_logprobs" not in plain.column_names
    assert plain["output_token_ids"].to_pylist() == res["output_token_ids"].to_pylist()


def test_scoring_job_labels_and_column(tmp_path, run_model, run_data):
    tok = load_tokenizer(run_model).tokenizer
    labels = [" the", " and", "xyzzy"]  # at least one multi-token label on this tokenizer
    assert any(len(tok.encode(s, add_special_tokens=False).ids) > 1 for s in labels)
    data = pq.read_table(run_data)
    n = data.num_rows
    per_row: list = [None] * n
    per_row[1] = [" a", " b"]
    per_row[2] = [" a", " a"]  # not distinct: rejected
    per_row[3] = []  # empty: the job's labels
    data = data.append_column("cands", pa.array(per_row, pa.list_(pa.string())))
    path = tmp_path / "labels.parquet"
    pq.write_table(data, path)
    res = run_ok(
        tmp_path,
        run_model,
        path,
        "score.parquet",
        ['[sampling] labels = [" the", " and", "xyzzy"]', '[input] labels_column = "cands"'],
    )
    rows = res.to_pylist()
    assert rows[2]["status"] == "invalid_labels" and "input.labels_column" in rows[2]["message"]
    for i, row in enumerate(rows):
        if i == 2:
            continue
        want = per_row[i] or labels
        assert row["status"] == "ok" and row["finish_reason"] == "score"
        assert len(row["label_logprobs"]) == len(want)
        assert all(v < 0 and math.isfinite(v) for v in row["label_logprobs"])
        assert row["label"] == want[int(np.argmax(row["label_logprobs"]))] == row["output_text"]
        assert row["num_output_tokens"] == 0


def test_per_row_settings(tmp_path, run_model, run_data):
    data = pq.read_table(run_data)
    n = data.num_rows
    temp = [None] * n
    temp[0], temp[1], temp[2] = 0.9, -1.0, 0.0  # row 1: bad value
    top_k = [None] * n
    top_k[0] = 5
    seed = [None] * n
    seed[0], seed[3] = 11, -2  # row 3: bad value
    stop: list = [None] * n
    data = (
        data.append_column("t", pa.array(temp, pa.float64()))
        .append_column("k", pa.array(top_k, pa.int32()))
        .append_column("s", pa.array(seed, pa.int64()))
        .append_column("st", pa.array(stop, pa.list_(pa.string())))
    )
    path = tmp_path / "settings.parquet"
    pq.write_table(data, path)
    cols = [
        '[input] temperature_column = "t"',
        '[input] top_k_column = "k"',
        '[input] seed_column = "s"',
        '[input] stop_column = "st"',
    ]
    a = run_ok(tmp_path, run_model, path, "a.parquet", cols).to_pylist()
    b = run_ok(tmp_path, run_model, path, "b.parquet", cols).to_pylist()
    greedy = run_ok(tmp_path, run_model, run_data, "g.parquet", []).to_pylist()
    assert a[1]["status"] == "invalid_temperature" and "input.temperature_column" in a[1]["message"]
    assert a[3]["status"] == "invalid_seed"
    assert a == b  # seeded rows are reproducible
    for i in range(n):
        if i not in (0, 1, 3):  # no override (or temperature 0): the greedy outputs
            assert a[i]["output_token_ids"] == greedy[i]["output_token_ids"]


def test_per_row_stop_strings(tmp_path, run_model, run_data):
    greedy = run_ok(tmp_path, run_model, run_data, "g2.parquet", []).to_pylist()
    text = greedy[0]["output_text"]
    cut = text[len(text) // 2 :][:3]
    assert cut.strip()
    data = pq.read_table(run_data)
    stop: list = [None] * data.num_rows
    stop[0] = [cut]
    path = tmp_path / "stop.parquet"
    pq.write_table(data.append_column("st", pa.array(stop, pa.list_(pa.string()))), path)
    res = run_ok(tmp_path, run_model, path, "st.parquet", ['[input] stop_column = "st"'])
    rows = res.to_pylist()
    assert rows[0]["output_text"] == text[: text.find(cut)] and rows[0]["finish_reason"] == "stop"
    assert rows[1]["output_text"] == greedy[1]["output_text"]


def test_missing_or_mistyped_column_is_exit_4(tmp_path, run_model, run_data):
    for key, col in (("temperature_column", "nope"), ("stop_column", "request_id")):
        job = write_job(tmp_path, run_model, run_data, f"{key}.parquet")
        job.write_text(job.read_text().replace("[input]\n", f'[input]\n{key} = "{col}"\n'))
        r = cli("run", job, "--no-progress")
        assert r.exit_code == EXIT_INPUT, r.output
        assert f"input.{key}" in (r.stderr or r.output)


def test_bad_sampling_keys_name_the_key(tmp_path, run_model, run_data):
    for setting, key in (("logprobs = 21", "sampling.logprobs"), ("labels = []", None)):
        job = write_job(tmp_path, run_model, run_data, "bad.parquet")
        job.write_text(job.read_text().replace("[sampling]\n", f"[sampling]\n{setting}\n"))
        r = cli("plan", job)
        if key is None:  # an empty label list is simply "no scoring"
            assert r.exit_code == 0, r.output
        else:
            assert r.exit_code != 0 and key in (r.stderr or r.output)


def test_ranking_example_runs(tmp_path):
    """jobs/ranking_labels.toml on the tiny model (examples/ranking.py's dataset)."""
    if not (ROOT / "models" / "tiny-llama" / "config.json").exists():
        pytest.skip("the tiny model of `make demo` is not built")
    data = tmp_path / "pairs.parquet"
    pq.write_table(ranking_table(60, seed=1), data)
    out = tmp_path / "ranking.parquet"
    p = cli_subprocess(
        "run",
        ROOT / "jobs" / "ranking_labels.toml",
        "--set",
        f"input.path={data}",
        "--set",
        f"output.path={out}",
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr
    res = pq.read_table(out).to_pylist()
    assert len(res) == 60 and all(r["label"] in (" yes", " no") for r in res)
    assert all(len(r["label_logprobs"]) == 2 for r in res)


def test_labels_past_the_context_reject_the_row(tmp_path, run_model, run_data):
    tok = load_tokenizer(run_model)
    prompts = pq.read_table(run_data)["prompt"].to_pylist()
    lengths = tok.encode(prompts)[1]
    label_len = len(tok.tokenizer.encode("xyzzy", add_special_tokens=False).ids)
    assert label_len > 1
    ctx = int(lengths.max()) + 1  # every prompt fits; the longest + the label does not
    res = run_ok(
        tmp_path,
        run_model,
        run_data,
        "ctx.parquet",
        ['[sampling] labels = ["xyzzy"]', f"[model] max_model_len = {ctx}"],
    ).to_pylist()
    for n, row in zip(lengths, res, strict=True):
        if n + label_len - 1 > ctx - 1:
            assert row["status"] == "prompt_too_long" and "longest label" in row["message"]
        else:
            assert row["status"] == "ok" and row["label"] == "xyzzy"
    assert any(r["status"] == "prompt_too_long" for r in res)
