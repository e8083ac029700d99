"""A run's results committed in bounded memory, one results file at a time.

The in-memory commit (``ResultSink.finalize``) joins every part and the whole pass-through
table at once. A partitioned run (``batchjob.runner.run_stream``) has one result row per
input row (``sampling.n`` 1) and row ids that are input positions, so results file ``i`` of
the commit holds exactly rows ``[i * R, (i + 1) * R)`` (``R`` = ``output.rows_per_file``),
the file the in-memory commit writes. Two passes:

1. ``bucket_parts``: every part, read a few at a time, is split by ``row_id // R`` into
   per-file buckets under a work folder (length-prefixed Arrow IPC blobs appended to one
   file per bucket); each row id is checked in a bitmap as it goes, so a row missing, out of
   range or written twice stops the commit before anything is written (parts kept).
2. ``StreamedResults.chunks``: bucket by bucket, its rows sorted by row_id and joined with
   the same rows' pass-through columns, read again from the input in order.

Peak memory: a bucket, its pass-through rows and a read of parts, not the dataset.
``RowBits`` (one bit per input row) is also the done-row set of a resumed run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchjob.inputs.parquet import ROW_ID
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import with_passthrough

READ_ROWS = 1 << 18  # result rows read from the parts before they are split into buckets


class RowBits:
    """A set of row ids in ``[0, n)``: one bit each."""

    def __init__(self, n: int):
        self.n = n
        self.bits = np.zeros((n + 7) // 8, dtype=np.uint8)

    def has(self, ids: np.ndarray) -> np.ndarray:
        """bool [len(ids)]: which ids are in the set (ids in range)."""
        ids = np.asarray(ids, dtype=np.int64)
        return ((self.bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1).astype(bool)

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        np.bitwise_or.at(self.bits, ids >> 3, (1 << (ids & 7)).astype(np.uint8))

    def count(self) -> int:
        return int(np.unpackbits(self.bits).sum()) if self.n else 0


def done_rows(layout: OutputLayout, num_rows: int) -> RowBits:
    """The row ids the parts of ``layout`` hold (an earlier run's), one part at a time."""
    done = RowBits(num_rows)
    for p in layout.part_files():
        ids = layout.store.read_parquet(p, columns=[ROW_ID])[ROW_ID].to_numpy()
        done.add(ids[(ids >= 0) & (ids < num_rows)])
    return done


def _append(path: Path, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    blob = sink.getvalue()
    with open(path, "ab") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)


def _read(path: Path) -> list[pa.Table]:
    out: list[pa.Table] = []
    if not path.exists():
        return out
    with open(path, "rb") as f:
        while head := f.read(8):
            blob = f.read(int.from_bytes(head, "little"))
            out.append(pa.ipc.open_stream(pa.py_buffer(blob)).read_all())
    return out


def _parts_in_reads(layout: OutputLayout, schema: pa.Schema) -> Iterator[pa.Table]:
    """The parts' rows, ``READ_ROWS`` or so at a time."""
    pending: list[pa.Table] = []
    rows = 0
    for p in layout.part_files():
        t = layout.store.read_parquet(p, schema=schema)
        pending.append(t)
        rows += t.num_rows
        if rows >= READ_ROWS:
            yield pa.concat_tables(pending)
            pending, rows = [], 0
    if pending:
        yield pa.concat_tables(pending)


@dataclass(frozen=True)
class StreamedResults:
    """Parts split into per-file buckets (``bucket_parts``), ready to commit."""

    folder: Path
    schema: pa.Schema  # the result columns (``ResultSink.schema``)
    num_rows: int
    rows_per_file: int

    @property
    def num_files(self) -> int:
        return max(-(-self.num_rows // self.rows_per_file), 1)

    def bucket(self, i: int) -> Path:
        return self.folder / f"b{i:06d}.arrows"

    def chunks(self, passthrough: Iterable[pa.Table], columns: pa.Schema) -> Iterator[pa.Table]:
        """Results file by file: rows sorted by row_id, the pass-through columns of
        ``passthrough`` (the input's, in row order; ``columns``: their schema over every
        file) appended as ``with_passthrough`` does."""
        rows = _Rows(iter(passthrough), columns)
        for i in range(self.num_files):
            lo = i * self.rows_per_file
            hi = min(lo + self.rows_per_file, self.num_rows)
            parts = _read(self.bucket(i))
            table = pa.concat_tables(parts) if parts else self.schema.empty_table()
            yield with_passthrough(table, rows.take(lo, hi))
            self.bucket(i).unlink(missing_ok=True)


def bucket_parts(
    layout: OutputLayout, schema: pa.Schema, folder: Path, num_rows: int, rows_per_file: int
) -> StreamedResults:
    """Split the parts of ``layout`` into one bucket per results file under ``folder``;
    RuntimeError (nothing committed, parts kept) unless they hold each of ``num_rows`` rows
    exactly once."""
    out = StreamedResults(folder, schema, num_rows, rows_per_file)
    seen = RowBits(num_rows)
    where = f"parts kept in {layout.parts}"
    for t in _parts_in_reads(layout, schema):
        ids = t[ROW_ID].to_numpy()
        bad = (ids < 0) | (ids >= num_rows)
        if bad.any():
            raise RuntimeError(f"results hold row {int(ids[bad][0])} of {num_rows} rows; {where}")
        uniq, counts = np.unique(ids, return_counts=True)
        twice = uniq[counts > 1]
        again = uniq[seen.has(uniq)]
        if len(twice) or len(again):
            row = int(np.concatenate([twice, again]).min())
            raise RuntimeError(f"row {row} is in the parts twice; {where}")
        seen.add(uniq)
        bucket = ids // rows_per_file
        order = np.argsort(bucket, kind="stable")
        b = bucket[order]
        cuts = np.flatnonzero(np.diff(b)) + 1
        for idx in np.split(order, cuts):
            _append(out.bucket(int(bucket[idx[0]])), t.take(pa.array(idx)))
    if (have := seen.count()) != num_rows:
        raise RuntimeError(f"results hold {have} rows for {num_rows} expected; {where}")
    return out


class _Rows:
    """Rows ``[lo, hi)`` of a stream of tables with consecutive row ids, asked in order."""

    def __init__(self, tables: Iterator[pa.Table], schema: pa.Schema):
        self.tables = tables
        self.schema = schema
        self.buf: list[pa.Table] = []
        self.start = 0  # row id of the buffer's first row
        self.end = 0  # one past its last

    def take(self, lo: int, hi: int) -> pa.Table:
        while self.end < hi:
            t = next(self.tables, None)
            if t is None:
                break
            self.buf.append(_conform(t, self.schema))
            self.end += t.num_rows
        whole = pa.concat_tables(self.buf) if self.buf else self.schema.empty_table()
        out = whole.slice(lo - self.start, hi - lo)
        rest = whole.slice(hi - self.start)
        self.buf, self.start = ([rest] if rest.num_rows else []), hi
        return out


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with the columns and types of ``schema`` (missing ones null), as the
    in-memory pass-through table has them (``PassthroughCollector``)."""
    if table.schema.equals(schema):
        return table
    both = pa.concat_tables([schema.empty_table(), table], promote_options="permissive")
    return both.select(schema.names).cast(schema)
