"""Results held in memory (``batchjob.generate``): the rows of one in-memory table, as one Arrow
table of the job's result columns plus the input's pass-through columns, in input order; the
same columns, built by the same functions, as the results files of ``batchjob run``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchjob.inputs.parquet import ROW_ID
from batchjob.outputs.results import (
    ResultRow,
    result_keys,
    result_schema,
    rows_table,
    with_passthrough,
)


class MemorySink:
    """Collects finished rows (a ``RowSink``), turned into Arrow every ``buffer_rows`` rows."""

    def __init__(self, extra_columns: tuple[str, ...] = (), buffer_rows: int = 4096) -> None:
        self.schema = result_schema(extra_columns)
        self.buffer_rows = buffer_rows
        self._buffer: list[ResultRow] = []
        self._tables: list[pa.Table] = []

    def add(self, row: ResultRow) -> None:
        self._buffer.append(row)
        if len(self._buffer) >= self.buffer_rows:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._tables.append(rows_table(self._buffer, self.schema))
            self._buffer = []

    def table(self, passthrough: pa.Table, expected: int | None = None) -> pa.Table:
        """Every row's result with its pass-through columns, in row_id order (then
        sample_index); RuntimeError unless each row of ``passthrough`` has a result, and
        there are ``expected`` (default: one per row), none twice."""
        self.flush()
        results = pa.concat_tables(self._tables) if self._tables else self.schema.empty_table()
        self._tables = []
        keys = result_keys(results)
        want = passthrough[ROW_ID].to_numpy()
        expected = len(want) if expected is None else expected
        rows = np.unique(results[ROW_ID].to_numpy())
        distinct = len(np.unique(keys))
        if (
            len(keys) != expected
            or distinct != expected
            or not np.array_equal(rows, np.unique(want))
        ):
            raise RuntimeError(
                f"{len(keys)} results ({distinct} distinct) for {len(want)} input rows, "
                f"{expected} expected"
            )
        return with_passthrough(results, passthrough).combine_chunks()
