"""What the runnable examples under ``examples/`` share: write the example's dataset, then
run its job file with ``batchjob plan`` and ``batchjob run`` as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from batchjob.storage.atomic import write_parquet_atomic


def write_and_run(table: pa.Table, data: Path, job: Path, root: Path, no_run: bool) -> int:
    """``table`` to ``data``; then, unless ``no_run``, ``batchjob plan`` and ``batchjob run``
    of ``job`` from ``root`` (paths printed relative to it). The first failing command's exit
    status, else 0."""
    write_parquet_atomic(table, data)
    print(f"wrote {table.num_rows} rows to {data.relative_to(root)}")
    if no_run:
        return 0
    for cmd in ("plan", "run"):
        print(f"$ batchjob {cmd} {job.relative_to(root)}")
        rc = subprocess.call([sys.executable, "-m", "batchjob.cli", cmd, str(job)], cwd=root)
        if rc:
            return rc
    return 0
