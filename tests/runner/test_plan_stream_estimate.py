"""The token estimate that decides whether a job plans in partitions counts the text its
prompts are built from: a template's columns and literal text, chat messages and their
markup, not only a prompt column the files may not have."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import load_job
from batchjob.inputs.source import open_input
from batchjob.plan.budget import plan_bytes
from batchjob.runner.plan_stream import (
    CHAT_BYTES_PER_ROW,
    estimated_tokens,
    partitioned_reason,
)
from batchjob.runner.prepare import prepare

ROWS = 400


def _data(tmp_path: Path) -> Path:
    text = "zoge zeza fivi pepi mipu rome guno dove biza piki " * 4
    t = pa.table(
        {
            "title": [f"title {i}" for i in range(ROWS)],
            "context": [text] * ROWS,
            "messages": [[{"role": "user", "content": f"{text} {i}"}] for i in range(ROWS)],
        }
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(t, path)
    return path


def _job(tmp_path: Path, model: Path, **sets: str):
    base = {"input.path": str(_data(tmp_path)), "model.path": str(model)}
    return load_job(None, base | {"output.path": str(tmp_path / "out")} | sets)


def test_a_template_counts_its_columns_and_its_literal_text(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    job = _job(tmp_path, tiny_model_dir, **{"input.template": "Title: {title}\n\n{context}\nA:"})
    est = estimated_tokens(open_input(job.input))  # as pipeline opens it: no model section
    tokens = len(prepare(job).loaded.prompts.tokens)
    assert 0.4 * tokens < est < 2.5 * tokens
    # a budget the rows alone fit: the prompts' tokens put the job over it
    budget = plan_bytes(ROWS, 0) + 1024
    over = _job(
        tmp_path,
        tiny_model_dir,
        **{
            "input.template": "Title: {title}\n\n{context}\nA:",
            "scheduler.plan_memory": str(budget),
        },
    )
    assert partitioned_reason(over, open_input(over.input)) is not None


def test_chat_messages_count_their_text_and_markup(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, **{"input.messages_column": "messages"})
    est = estimated_tokens(open_input(job.input))
    meta = pq.read_metadata(job.input.path)
    sizes = [
        meta.row_group(0).column(i).total_uncompressed_size
        for i in range(meta.num_columns)
        if meta.schema.column(i).path.split(".")[0] == "messages"
    ]
    least = ROWS * CHAT_BYTES_PER_ROW // 4 + sum(n // 4 for n in sizes)
    assert least <= est < 1.5 * least  # (a dictionary of roles counts as its values)
    assert sum(sizes) // 4 > ROWS * 50  # the messages' text, not the rows alone
