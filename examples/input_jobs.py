"""The input-side example jobs (prompt template, OpenAI Batch file) on the demo's tiny model:

    python examples/input_jobs.py            # or: make demo-inputs

builds models/tiny-llama (as `make demo` does) if missing, writes
data/snippets/articles.parquet (articles x questions, shuffled, one null question) and
data/openai/requests.jsonl (OpenAI Batch chat requests, one malformed line), then runs
jobs/snippets_template.toml and jobs/openai_migration.toml with the real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

from batchjob.storage.atomic import write_parquet_atomic, write_text_atomic  # noqa: E402
from batchjob.testing.workloads import WORDS  # noqa: E402

ARTICLES = ROOT / "data" / "snippets" / "articles.parquet"
REQUESTS = ROOT / "data" / "openai" / "requests.jsonl"
JOBS = ("jobs/snippets_template.toml", "jobs/openai_migration.toml")


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def make_articles(path: Path, articles: int = 8, questions: int = 5, seed: int = 0) -> Path:
    """articles x questions rows (shuffled): article_id, title, context, question, max_tokens.
    One question is null: that row gets status null_field."""
    rng = np.random.default_rng(seed)
    rows = []
    for a in range(articles):
        title, context = _words(rng, 4), _words(rng, 120)
        for _ in range(questions):
            rows.append((a, title, context, _words(rng, 8) + "?", int(rng.integers(4, 12))))
    order = rng.permutation(len(rows))
    cols = list(zip(*(rows[i] for i in order), strict=True))
    question = list(cols[3])
    question[1] = None
    table = pa.table(
        {
            "article_id": pa.array(cols[0], pa.int64()),
            "title": pa.array(cols[1], pa.string()),
            "context": pa.array(cols[2], pa.string()),
            "question": pa.array(question, pa.string()),
            "max_tokens": pa.array(cols[4], pa.int32()),
        }
    )
    write_parquet_atomic(table, path)
    return path


def make_requests(path: Path, n: int = 24, seed: int = 0) -> Path:
    """OpenAI Batch chat requests sharing a system prompt and a few documents; line 5 is
    not JSON (its row gets status invalid_request and an error line)."""
    rng = np.random.default_rng(seed)
    docs = [_words(rng, 80) for _ in range(4)]
    system = "You answer questions about documents. " + _words(rng, 24)  # one for all
    lines = []
    for i in range(n):
        body = {
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{docs[i % 4]}\n\nQuestion: {_words(rng, 6)}?"},
            ],
            "max_tokens": int(rng.integers(3, 10)),
            "temperature": 0,
        }
        req = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps({**req, "body": body}))
    lines[4] = lines[4][:-7]  # cut short: not valid JSON
    write_text_atomic("\n".join(lines) + "\n", path)
    return path


def main() -> int:
    from demo import build_model  # examples/ is on sys.path when run as a script

    build_model()
    make_articles(ARTICLES)
    make_requests(REQUESTS)
    print(f"wrote {ARTICLES.relative_to(ROOT)} and {REQUESTS.relative_to(ROOT)}")
    for job in JOBS:
        print(f"$ batchjob run {job}")
        rc = subprocess.call([sys.executable, "-m", "batchjob.cli", "run", job], cwd=ROOT)
        if rc != 0:
            return rc
    results = pq.read_table(ROOT / "out" / "snippets" / "results.parquet").sort_by("row_id")
    print("\nsnippets: " + ", ".join(f"{s} x{c}" for s, c in _counts(results["status"])))
    out = (ROOT / "out" / "openai" / "results.jsonl").read_text().splitlines()
    print(f"openai: {len(out)} output lines; first two:")
    for line in out[:2]:
        print("  " + line[:160])
    return 0


def _counts(col: pa.ChunkedArray) -> list[tuple[str, int]]:
    values, counts = np.unique(np.asarray(col.to_pylist(), dtype=object), return_counts=True)
    return list(zip(values.tolist(), counts.tolist(), strict=True))


if __name__ == "__main__":
    sys.exit(main())
