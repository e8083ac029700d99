"""`make demo`: build a tiny model and a demo dataset locally, then run jobs/demo.toml.

Everything is made here (no download): a random-weight Llama with a BPE tokenizer trained
on the demo vocabulary, and a small snippet-generation dataset (documents shared by several
questions, rows shuffled). Then the real CLI runs the job and the first results are shown.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import pyarrow.parquet as pq  # noqa: E402

from batchjob.config import load_job  # noqa: E402
from batchjob.outputs.naming import OutputLayout  # noqa: E402
from batchjob.storage.atomic import write_parquet_atomic  # noqa: E402
from batchjob.testing.tiny_model import make_tiny_model  # noqa: E402
from batchjob.testing.workloads import WORDS, make_workload  # noqa: E402

MODEL = ROOT / "models" / "tiny-llama"
DATA = ROOT / "data" / "demo" / "prompts.parquet"
JOB = ROOT / "jobs" / "demo.toml"


def corpus() -> list[str]:
    """Sentences over the workload vocabulary, so the tokenizer keeps words whole."""
    step = 16
    return [" ".join(WORDS[i : i + step]) for i in range(0, len(WORDS), step)] * 2


def build_model() -> None:
    """The demo's tiny model in models/tiny-llama, unless it is there already."""
    if not (MODEL / "config.json").exists():
        print(f"building tiny model in {MODEL.relative_to(ROOT)}")
        make_tiny_model(
            MODEL,
            family="llama",
            vocab_size=3000,
            hidden=128,
            layers=4,
            heads=4,
            kv_heads=2,
            corpus=corpus(),
        )


def main() -> int:
    build_model()
    table = make_workload("case1", scale=0.02, len_scale=0.1, seed=0, form="text", max_tokens=16)
    write_parquet_atomic(table, DATA)
    print(f"wrote {table.num_rows} prompts to {DATA.relative_to(ROOT)}")
    cli = [sys.executable, "-m", "batchjob.cli", "run", str(JOB)]
    print("$ batchjob run jobs/demo.toml")
    rc = subprocess.call(cli, cwd=ROOT)
    if rc != 0:
        return rc
    results = pq.read_table(ROOT / "out" / "demo" / "results.parquet")
    print(f"\n{results.num_rows} result rows; first three:")
    for row in results.slice(0, 3).to_pylist():
        print(
            f"  row {row['row_id']}: {row['status']} {row['finish_reason']!s:6} "
            f"{row['num_prompt_tokens']} prompt tokens -> {row['output_text'][:60]!r}"
        )
    report = json.loads(OutputLayout.of(load_job(JOB).output).report_file.read_text())
    print(
        f"saving ratio: planned {report['saving_ratio_planned']:.1%}, achieved "
        f"{report['saving_ratio_achieved']:.1%}; {report['generated_tokens_per_s']:.0f} "
        f"generated tok/s over {report['iterations']} iterations"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
