"""Report: outcome counts over the final results (file or folder), the JSON/Parquet/PNG set."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.backends.base import BackendRun, IterationRecord
from batchjob.outputs.report import outcome_counts, summarize, write_report
from batchjob.outputs.results import RESULT_SCHEMA


def results_table(statuses, reasons):
    n = len(statuses)
    return pa.table(
        {
            "row_id": list(range(n)),
            "output_text": [None] * n,
            "output_token_ids": [None] * n,
            "num_prompt_tokens": [1] * n,
            "num_output_tokens": [0] * n,
            "finish_reason": reasons,
            "status": statuses,
            "message": [None] * n,
        },
        schema=RESULT_SCHEMA,
    )


STATUSES = ["ok", "ok", "empty_prompt", "ok", "prompt_too_long", "ok"]
REASONS = ["stop", "length", None, "stop", None, "stop"]
EXPECTED = {"empty_prompt/-": 1, "ok/length": 1, "ok/stop": 3, "prompt_too_long/-": 1}


def test_outcome_counts_of_a_file_and_of_a_folder_of_parts(tmp_path):
    table = results_table(STATUSES, REASONS)
    pq.write_table(table, tmp_path / "results.parquet")
    assert outcome_counts(tmp_path / "results.parquet") == EXPECTED
    folder = tmp_path / "out"
    folder.mkdir()
    pq.write_table(table.slice(0, 4), folder / "results-00000.parquet")
    pq.write_table(table.slice(4), folder / "results-00001.parquet")
    files = ["results-00000.parquet", "results-00001.parquet"]
    success = {"committer": "batchjob", "files": files}
    (folder / "_SUCCESS").write_text(json.dumps(success))
    assert outcome_counts(folder) == EXPECTED
    (folder / "_SUCCESS").write_text("")  # not batchjob's _SUCCESS: no committed results
    assert outcome_counts(folder) == {}


def test_report_files_carry_the_outcomes(tmp_path):
    pq.write_table(results_table(STATUSES, REASONS), tmp_path / "results.parquet")
    recs = [
        IterationRecord(i, 4 - i, 4 * (i < 2), 4, i + 1, 64 * (i + 1), 0, 0.1) for i in range(4)
    ]
    run = BackendRun(recs, 8, 0, 0, 256, 1024, 0.4)
    summary = summarize(
        run,
        prompt_tokens=10,
        generated_tokens=5,
        requests_run=4,
        rows={"total": 6, "ok": 4, "rejected": 2, "skipped": 0},
        plan_ratios=(0.5, 0.6),
        total_s=2.0,
        stage_s={"run_s": 1.0},
        policy="batchllm",
        device="cpu",
        results=tmp_path / "results.parquet",
    )
    assert summary.outcomes == EXPECTED and summary.tecd_s == 0.2
    paths = write_report(summary, run, tmp_path / "results.report.json")
    assert json.loads(paths["json"].read_text())["outcomes"] == EXPECTED
    assert paths["timeline"].read_bytes()[:4] == b"\x89PNG"
    assert pq.read_table(paths["iterations"]).num_rows == 4
    row = pq.read_table(paths["summary"]).to_pylist()[0]
    assert row["rows_rejected"] == 2 and "outcomes" not in row and "stage_s" not in row
