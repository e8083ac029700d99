"""The input-side example jobs end to end on a tiny model, through the real CLI:
jobs/snippets_template.toml (prompts from columns) and jobs/openai_migration.toml (OpenAI
Batch requests in, Batch output lines out), with their data from examples/input_jobs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from examples.input_jobs import make_articles, make_requests
from tests.e2e.jobkit import ROOT, cli, cli_subprocess, killed_run, read_results, write_job

SNIPPETS = ROOT / "jobs" / "snippets_template.toml"
OPENAI = ROOT / "jobs" / "openai_migration.toml"
FAST = ("--set", "model.device=cpu", "--set", "engine.threads=1")


def _args(job: Path, data: Path, model: Path, out: Path) -> list[str | Path]:
    return [job, "--input", data, "--model", model, "--output", out, *FAST]


def test_snippets_template_job(tmp_path: Path, run_model: Path) -> None:
    data = make_articles(tmp_path / "articles.parquet", articles=4, questions=4)
    out = tmp_path / "out" / "results.parquet"
    plan = cli("plan", *_args(SNIPPETS, data, run_model, out), "--json")
    assert plan.exit_code == 0, plan.stderr
    summary = json.loads(plan.stdout)
    assert summary["ok"] == 15 and summary["rejected"] == {"null_field": 1}
    assert summary["saving_ratio_single_level"] > 0.5  # the article is each group's prefix

    r = cli("run", *_args(SNIPPETS, data, run_model, out), "--no-progress")
    assert r.exit_code == 0, r.stderr
    res = read_results(out)
    inp = pq.read_table(data)
    assert res.num_rows == inp.num_rows == 16
    status = res["status"].to_pylist()
    nulls = [i for i, q in enumerate(inp["question"].to_pylist()) if q is None]
    assert [i for i, s in enumerate(status) if s != "ok"] == nulls
    bad = res.slice(nulls[0], 1).to_pylist()[0]
    assert bad["status"] == "null_field" and "'question'" in bad["message"]
    ok = [row for row in res.to_pylist() if row["status"] == "ok"]
    assert all(0 < row["num_output_tokens"] <= row["max_tokens"] for row in ok)
    assert res["article_id"].to_pylist() == inp["article_id"].to_pylist()  # pass-through


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_openai_migration_job(tmp_path: Path, run_model: Path) -> None:
    requests = make_requests(tmp_path / "requests.jsonl", n=12)
    sent = [
        json.loads(x) if i != 4 else None for i, x in enumerate(requests.read_text().splitlines())
    ]
    out = tmp_path / "out" / "results.parquet"
    args = _args(OPENAI, requests, run_model, out)
    # killed after the results are committed, before the output lines: the rerun writes them
    killed = killed_run(*args, spec="report:1")
    assert killed.returncode == -9 and not (tmp_path / "out" / "results.jsonl").exists()
    r = cli_subprocess("run", *args, "--no-progress")
    assert r.returncode == 0, r.stderr

    res = read_results(out).to_pylist()
    lines = _lines(tmp_path / "out" / "results.jsonl")
    assert len(lines) == len(res) == 12
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(12)]
    for i, (line, row) in enumerate(zip(lines, res, strict=True)):
        assert line["id"] and row["custom_id"] in (line["custom_id"], None)
        if i == 4:  # the cut line: its error names the line; its custom_id recovered
            assert line["response"] is None and row["status"] == "invalid_request"
            assert line["error"]["code"] == "invalid_request"
            assert "line 5: invalid JSON" in line["error"]["message"]
            continue
        assert line["error"] is None and row["status"] == "ok"
        resp = line["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        assert body["object"] == "chat.completion"
        assert body["model"] == (sent[i]["body"].get("model") or run_model.name)  # the request's
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": row["output_text"]}
        assert choice["finish_reason"] == row["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["completion_tokens"] == row["num_output_tokens"]
        assert usage["completion_tokens"] <= sent[i]["body"]["max_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # complete already: the rerun changes nothing
    before = (tmp_path / "out" / "results.jsonl").read_bytes()
    again = cli("run", *args, "--set", "output.overwrite=false", "--no-progress")
    assert again.exit_code == 0 and "already complete" in again.stdout
    assert (tmp_path / "out" / "results.jsonl").read_bytes() == before


@pytest.mark.parametrize("endpoint", ["/v1/completions"])
def test_openai_completions_and_parquet_input(
    tmp_path: Path, run_model: Path, run_data: Path, endpoint: str
) -> None:
    reqs = [
        {
            "custom_id": f"k{i}",
            "method": "POST",
            "url": endpoint,
            "body": {"prompt": p, "max_tokens": 3},
        }
        for i, p in enumerate(["babu bado bafe", "babu bado bake"])
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "c" / "results"
    r = cli("run", *_args(OPENAI, path, run_model, out), "--no-progress")
    assert r.exit_code == 0, r.stderr
    lines = _lines(tmp_path / "c" / "results.jsonl")
    assert [x["custom_id"] for x in lines] == ["k0", "k1"]
    body = lines[0]["response"]["body"]
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)

    # a Parquet job can write the same format: custom_id from input.id_column (else row-N)
    job = write_job(tmp_path, run_model, run_data, "p/results.parquet", format='"openai-jsonl"')
    r = cli("run", job, "--set", "input.id_column=request_id", "--no-progress")
    assert r.exit_code == 0, r.stderr
    lines = _lines(tmp_path / "p" / "results.jsonl")
    ids = pq.read_table(run_data)["request_id"].to_pylist()
    assert [x["custom_id"] for x in lines] == [str(i) for i in ids]
    assert lines[0]["response"]["body"]["object"] == "text_completion"
