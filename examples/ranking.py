"""Ranking with labels: build a (query, document) dataset, then run
``jobs/ranking_labels.toml`` on the tiny model.

    .venv/bin/python examples/ranking.py                 # 2,000 rows, plan + run
    .venv/bin/python examples/ranking.py --rows 100000   # the at-scale measurement

Each query comes with 8-16 candidate documents; a prompt is one instruction (the same in every
row), the query, then one document, then "relevant:"; rows are shuffled. The job scores the
labels " yes" and " no" after each prompt (scoring mode: no generation), so the run is all
prefill and the plan shares the instruction + query among a query's documents. The tiny model
(random weights, tokenizer trained on the workload's words) is the one ``make demo`` builds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchjob.testing.example_jobs import write_and_run
from batchjob.testing.workloads import ranking_table

ROOT = Path(__file__).resolve().parent.parent

DATA = ROOT / "data" / "ranking" / "pairs.parquet"
JOB = ROOT / "jobs" / "ranking_labels.toml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--no-run", action="store_true", help="write the dataset only")
    args = ap.parse_args()
    if not (ROOT / "models" / "tiny-llama" / "config.json").exists():
        print("build the tiny model first: make demo", file=sys.stderr)
        return 2
    return write_and_run(ranking_table(args.rows), DATA, JOB, ROOT, args.no_run)


if __name__ == "__main__":
    sys.exit(main())
