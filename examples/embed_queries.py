"""Embedding a query log: build a tiny Qwen3-Embedding-shaped model and a query dataset, then
run ``jobs/embed_queries.toml`` (``batchjob plan``, then ``batchjob run``).

    .venv/bin/python examples/embed_queries.py                # 2,000 queries, plan + run
    .venv/bin/python examples/embed_queries.py --rows 100000  # a larger log

The model is random weights with a locally trained tokenizer and the sentence-transformers
files of an embedding model (last-token pooling, normalized); every prompt is the same
instruction followed by one query, so the plan computes the instruction once per group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchjob.testing.embedding_model import make_tiny_embedding_model
from batchjob.testing.example_jobs import write_and_run
from batchjob.testing.workloads import WORDS

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-qwen3-embed"
DATA = ROOT / "data" / "embed" / "queries.parquet"
JOB = ROOT / "jobs" / "embed_queries.toml"


def queries(rows: int, seed: int = 0) -> pa.Table:
    """``rows`` queries of 3-12 words of the workload's vocabulary, with an id column."""
    rng = np.random.default_rng(seed)
    words = np.asarray(WORDS, dtype=object)
    text = [" ".join(words[rng.integers(0, len(words), rng.integers(3, 13))]) for _ in range(rows)]
    return pa.table({"query_id": np.arange(rows, dtype=np.int64), "query": text})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--no-run", action="store_true", help="write the model and dataset only")
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
        make_tiny_embedding_model(MODEL, family="qwen3", pooling="last", vocab_size=2500,
                                  corpus=corpus)  # fmt: skip
    return write_and_run(queries(args.rows), DATA, JOB, ROOT, args.no_run)


if __name__ == "__main__":
    sys.exit(main())
