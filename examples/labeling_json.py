"""The structured-output example job on the demo's tiny model:

    python examples/labeling_json.py

builds models/tiny-llama (as `make demo` does) if missing, writes data/labeling/questions.parquet
(one question per row), runs jobs/labeling_json.toml with the real CLI, and checks every `ok`
row's output_text against jobs/schemas/question_label.json (json + jsonschema when installed).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent

from batchjob.testing.workloads import WORDS  # noqa: E402

DATA = ROOT / "data" / "labeling" / "questions.parquet"
JOB = ROOT / "jobs" / "labeling_json.toml"
SCHEMA = ROOT / "jobs" / "schemas" / "question_label.json"
RESULTS = ROOT / "out" / "labeling" / "results.parquet"


def make_questions(path: Path, n: int = 32, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    qs = [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 8)) + "?" for _ in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"question_id": np.arange(n), "question": qs}), path)
    return path


def main() -> int:
    from demo import build_model  # examples/ is on sys.path when run as a script

    build_model()
    make_questions(DATA)
    rc = subprocess.call([sys.executable, "-m", "batchjob.cli", "run", str(JOB)], cwd=ROOT)
    if rc:
        return rc
    rows = pq.read_table(RESULTS).to_pylist()
    schema = json.loads(SCHEMA.read_text())
    try:
        from jsonschema import validate
    except ImportError:  # json.loads alone then
        validate = None
    for r in rows:
        if r["status"] == "ok":
            value = json.loads(r["output_text"])
            if validate is not None:
                validate(value, schema)
    print(collections.Counter((r["status"], r["finish_reason"]) for r in rows))
    print("every ok row is valid JSON of", SCHEMA.relative_to(ROOT))
    print("first row:", rows[0]["output_text"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
