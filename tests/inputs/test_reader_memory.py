"""The input reader holds about one row group of Arrow buffers, whatever the file's size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import InputConfig
from batchjob.inputs.parquet import open_dataset

GROUPS, ROWS, TOKENS = 24, 4096, 64  # ~1 MiB of random token ids a row group


def test_reading_a_file_holds_about_one_row_group(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "ids.parquet"
    schema = pa.schema([("prompt", pa.list_(pa.int32()))])
    offsets = pa.array(np.arange(ROWS + 1, dtype=np.int32) * TOKENS)
    with pq.ParquetWriter(path, schema) as w:
        for _ in range(GROUPS):
            values = pa.array(rng.integers(0, 2**31 - 1, size=ROWS * TOKENS, dtype=np.int32))
            w.write_table(pa.table([pa.ListArray.from_arrays(offsets, values)], schema=schema))
    group_bytes = ROWS * TOKENS * 4
    ds = open_dataset(InputConfig(path=str(path), batch_rows=1024))
    base = pa.total_allocated_bytes()
    peak = rows = 0
    for batch in ds.batches():
        rows += len(batch)
        peak = max(peak, pa.total_allocated_bytes() - base)
    assert rows == GROUPS * ROWS
    # ~4.6 row groups (compressed chunk, decoded arrays, a batch); one whole-file
    # iter_batches kept every pre-buffered chunk: ~40 here, growing with the file
    assert peak < 8 * group_bytes, f"{peak / group_bytes:.1f} row groups held"
