"""input.template builder speed: N rows (default 1,000,000) of title/context/question
columns (contexts shared by ~8 questions, one null in 1,000), built in the pipeline's
Arrow batches (input.batch_rows) with one polars concat_str per batch.

    python benchmarks/bench_template.py                 # 1,000,000 rows
    python benchmarks/bench_template.py --rows 100000 --batch-rows 65536

Prints seconds and rows/s for the builder alone, for streaming the Parquet file alone, and
for read + build through the InputDataset (Parquet streamed from a temp file).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchjob.config import load_job
from batchjob.inputs.parquet import open_dataset
from batchjob.inputs.template import PromptTemplate
from batchjob.testing.workloads import WORDS

TEMPLATE = "Article: {title}\n\n{context}\n\nQuestion: {question}\nAnswer:"


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    words = np.asarray(WORDS, dtype=object)
    n_docs = max(rows // 8, 1)
    docs = [" ".join(words[rng.integers(0, len(words), 60)]) for _ in range(min(n_docs, 5000))]
    doc_of = rng.integers(0, len(docs), rows)
    question = np.array([" ".join(words[rng.integers(0, len(words), 8)]) for _ in range(4096)])
    q = question[rng.integers(0, len(question), rows)].astype(object)
    q[rng.random(rows) < 0.001] = None
    return pa.table(
        {
            "title": pa.array([f"doc {d}" for d in doc_of], pa.string()),
            "context": pa.DictionaryArray.from_arrays(
                pa.array(doc_of, pa.int32()), pa.array(docs, pa.string())
            ).dictionary_decode(),
            "question": pa.array(q, pa.string()),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch-rows", type=int, default=65536)
    args = ap.parse_args()
    table = make_table(args.rows)
    tpl = PromptTemplate.parse(TEMPLATE)

    t0 = time.perf_counter()
    chars = nulls = 0
    for rb in table.to_batches(max_chunksize=args.batch_rows):
        prompts, null_col = tpl.render(pa.Table.from_batches([rb]))
        chars += len(prompts.buffers()[2] or b"")
        nulls += int((null_col != None).sum())  # noqa: E711
    build_s = time.perf_counter() - t0
    print(
        f"builder: {args.rows:,} rows in {build_s:.2f} s = {args.rows / build_s:,.0f} rows/s "
        f"({chars / 1e6:.0f} MB of prompt text, {nulls} null_field rows, "
        f"batches of {args.batch_rows})"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.parquet"
        pq.write_table(table, path)
        job = load_job(
            None,
            {
                "input.path": str(path),
                "input.template": TEMPLATE,
                "input.batch_rows": str(args.batch_rows),
                "output.path": str(Path(tmp) / "out"),
            },
        )
        t0 = time.perf_counter()
        n = sum(rb.num_rows for rb in ds.dataset(path).to_batches(batch_size=args.batch_rows))
        raw_s = time.perf_counter() - t0
        print(f"Parquet read alone: {n:,} rows in {raw_s:.2f} s = {n / raw_s:,.0f} rows/s")
        t0 = time.perf_counter()
        n = sum(len(b) for b in open_dataset(job.input).batches())
        read_s = time.perf_counter() - t0
    print(f"read + build (InputDataset): {n:,} rows in {read_s:.2f} s = {n / read_s:,.0f} rows/s")


if __name__ == "__main__":
    main()
