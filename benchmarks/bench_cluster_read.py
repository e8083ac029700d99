"""Read + tokenize of a cluster job: one process (``load_prompts``) vs Ray tasks over row
groups (``batchjob.runner.cluster.read.load_prompts_on_cluster``), on a local Ray cluster.

Writes ROWS rows of 12 words (``--form text``) or 12 token ids (``--form ids``) into one
Parquet file of row groups of ``--row-group`` rows, builds the tests' tiny model (its
tokenizer), starts ``ray.init(num_cpus=CPUS)`` (its start-up is printed apart), then times
each entry of ``--tasks`` in turn (1: one process; N: ``cluster.workers = N`` tasks).

    .venv/bin/python benchmarks/bench_cluster_read.py --rows 1000000 --tasks 1,2,1,2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from batchjob.config import load_job
from batchjob.runner.cluster.read import load_prompts_on_cluster
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.testing.workloads import WORDS
from batchjob.tokenize.batched import load_prompts


def write_job(tmp: Path, data: Path) -> Path:
    """The tests' tiny model (vocab 2,500, tokenizer trained on the workload's words)."""
    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    model = make_tiny_model(tmp / "tiny", vocab_size=2500, corpus=corpus)
    job = tmp / "job.toml"
    job.write_text(
        f'[input]\npath = "{data}"\n[model]\npath = "{model}"\ndevice = "cpu"\n'
        f'[output]\npath = "{tmp / "out"}"\n'
    )
    return job


def write_data(path: Path, rows: int, form: str, row_group: int) -> None:
    rng = np.random.default_rng(0)
    if form == "text":
        words = np.array(WORDS)[rng.integers(0, len(WORDS), (rows, 12))]
        prompts = pa.array([" ".join(r) for r in words])
    else:
        ids = rng.integers(100, 2400, rows * 12).astype(np.int32)
        prompts = pa.ListArray.from_arrays(np.arange(0, rows * 12 + 1, 12, dtype=np.int32), ids)
    pq.write_table(pa.table({"prompt": prompts}), path, row_group_size=row_group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--form", choices=["text", "ids"], default="text")
    ap.add_argument("--row-group", type=int, default=125_000)
    ap.add_argument("--tasks", default="1,2,1,2")
    ap.add_argument("--cpus", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data.parquet"
        write_data(data, args.rows, args.form, args.row_group)
        job = write_job(tmp, data)
        t = time.perf_counter()
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        print(f"ray.init: {time.perf_counter() - t:.2f} s")
        for n in map(int, args.tasks.split(",")):
            sets = {} if n == 1 else {"cluster.address": "local", "cluster.workers": str(n)}
            j = load_job(job, sets)
            t = time.perf_counter()
            if n == 1:
                loaded, _ = load_prompts(j.input, j.model, j.sampling, j.engine.backend)
            else:
                loaded, _ = load_prompts_on_cluster(j)
            print(
                f"{args.form} {loaded.num_rows} rows, {len(loaded.prompts.tokens)} tokens, "
                f"{n} {'process' if n == 1 else 'tasks'}: {time.perf_counter() - t:.2f} s",
                flush=True,
            )
        ray.shutdown()


if __name__ == "__main__":
    main()
