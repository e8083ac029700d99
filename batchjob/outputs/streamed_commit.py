"""A run's results committed in bounded memory, one results file at a time.

The in-memory commit (``ResultSink.finalize``) joins every part and the whole pass-through
table at once. A partitioned run (``batchjob.runner.run_stream``) has row ids that are input
positions, and ``ResultIndex`` says where each (row, sample) result lands among the job's
results in (row_id, sample) order: the row id itself with one result per row, else the
results of the rows before it (each rejected row one, each valid row its samples) plus the
sample. Results file ``i`` of the commit holds exactly results ``[i * R, (i + 1) * R)``
(``R`` = ``output.rows_per_file``), the file the in-memory commit writes. Two passes:

1. ``bucket_parts``: every part, read a few at a time, is split by ``index // R`` into
   per-file buckets under a work folder (length-prefixed Arrow IPC blobs appended to one
   file per bucket); each result is checked in a bitmap as it goes, so a result missing,
   out of range or written twice stops the commit before anything is written (parts kept).
2. ``StreamedResults.chunks``: bucket by bucket, its rows sorted by (row_id, sample) and
   joined with the same rows' pass-through columns, read back in order from the copy the
   spill pass wrote (``PassthroughSpill``), or from the input again.

Peak memory: a bucket, its pass-through rows and a read of parts, not the dataset.
``RowBits`` (one bit per result) is also the done set of a resumed run (``done_rows``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchjob.inputs.parquet import ROW_ID
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import SAMPLE_INDEX, with_passthrough

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


class ResultIndex:
    """Where each (row, sample) result lands among a job's results in (row_id, sample)
    order. ``starts`` (int64 [num_rows + 1], a memory map of a file in the run's work
    folder): the results before each input row; None: one result per row, the row id."""

    def __init__(self, num_rows: int, starts: np.ndarray | None = None):
        self.num_rows = num_rows
        self.starts = starts

    @property
    def num_results(self) -> int:
        return self.num_rows if self.starts is None else int(self.starts[-1])

    def of(self, row_ids: np.ndarray, samples: np.ndarray | None = None) -> np.ndarray:
        """int64: the result index of each (row id in range, sample) (sample None: 0)."""
        ids = np.asarray(row_ids, dtype=np.int64)
        if self.starts is None:
            return ids
        at = np.asarray(self.starts[ids], dtype=np.int64)
        return at if samples is None else at + np.asarray(samples, dtype=np.int64)

    def valid(self, row_ids: np.ndarray, samples: np.ndarray | None) -> np.ndarray:
        """bool: which (row id, sample) pairs name a result of the job."""
        ids = np.asarray(row_ids, dtype=np.int64)
        ok = (ids >= 0) & (ids < self.num_rows)
        if samples is None:
            return ok
        s = np.asarray(samples, dtype=np.int64)
        if self.starts is None:
            return ok & (s == 0)
        count = np.zeros(len(ids), dtype=np.int64)
        count[ok] = self.starts[ids[ok] + 1] - self.starts[ids[ok]]
        return ok & (s >= 0) & (s < count)

    def rows_of(self, lo: int, hi: int) -> tuple[int, int]:
        """The input rows ``[first, last)`` whose results ``[lo, hi)`` are (hi > lo)."""
        if self.starts is None:
            return lo, hi
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        last = int(np.searchsorted(self.starts, hi - 1, side="right"))
        return first, last


class ResultStarts:
    """Writes a ``ResultIndex``'s ``starts`` to ``path`` as the input's rows come, in row
    order (``add``: each row's number of results), then maps it (``index``)."""

    def __init__(self, path: Path):
        self.path = path
        self.total = 0
        self.rows = 0
        with open(path, "wb") as f:
            np.zeros(1, dtype=np.int64).tofile(f)

    def add(self, counts: np.ndarray) -> None:
        if not len(counts):
            return
        cum = self.total + np.cumsum(np.asarray(counts, dtype=np.int64))
        with open(self.path, "ab") as f:
            cum.tofile(f)
        self.total = int(cum[-1])
        self.rows += len(counts)

    def index(self) -> ResultIndex:
        starts = np.memmap(self.path, dtype=np.int64, mode="r", shape=(self.rows + 1,))
        return ResultIndex(self.rows, starts)


def _keys(t: pa.Table) -> tuple[np.ndarray, np.ndarray | None]:
    """(row ids, sample indices or None) of a results table (a null sample: 0)."""
    ids = t[ROW_ID].to_numpy()
    if SAMPLE_INDEX not in t.column_names:
        return ids, None
    return ids, t[SAMPLE_INDEX].fill_null(0).to_numpy(zero_copy_only=False)


def done_rows(layout: OutputLayout, num_rows: int, index: ResultIndex | None = None) -> RowBits:
    """The results the parts of ``layout`` hold (an earlier run's), one part at a time, as
    result indices (``index``; None: one result per row, the row ids)."""
    index = index or ResultIndex(num_rows)
    done = RowBits(index.num_results)
    for p in layout.part_files():
        # a job of samples (``starts`` set) writes sample_index in every part
        columns = [ROW_ID] if index.starts is None else [ROW_ID, SAMPLE_INDEX]
        ids, samples = _keys(layout.store.read_parquet(p, columns=columns))
        ok = index.valid(ids, samples)
        done.add(index.of(ids[ok], None if samples is None else samples[ok]))
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


class PassthroughSpill:
    """The input's pass-through columns, batch by batch as read, appended to ``path`` (Arrow
    IPC blobs, zstd; each keeps its batch's schema), read back in the same order by
    ``tables``: the commit joins them without reading the input again."""

    def __init__(self, path: Path):
        self.path = path
        self.path.write_bytes(b"")
        self._options = pa.ipc.IpcWriteOptions(compression="zstd")

    def add(self, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema, options=self._options) as w:
            w.write_table(table)
        blob = sink.getvalue()
        with open(self.path, "ab") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)

    def tables(self) -> Iterator[pa.Table]:
        """The tables in order; the file is opened here, so they read on after its folder
        is removed (as ``ResultStarts``' map does)."""
        return passthrough_tables(self.path)


def passthrough_tables(path: Path) -> Iterator[pa.Table]:
    """The tables of a ``PassthroughSpill`` another process wrote at ``path``, in order (the
    file is opened here)."""
    return _blobs(open(path, "rb"))


def _blobs(f) -> Iterator[pa.Table]:
    with f:
        while head := f.read(8):
            blob = f.read(int.from_bytes(head, "little"))
            yield pa.ipc.open_stream(pa.py_buffer(blob)).read_all()


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
    num_rows: int  # results
    rows_per_file: int
    index: ResultIndex | None = None  # None: one result per input row

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
        index = self.index or ResultIndex(self.num_rows)
        for i in range(self.num_files):
            lo = i * self.rows_per_file
            hi = min(lo + self.rows_per_file, self.num_rows)
            parts = _read(self.bucket(i))
            table = pa.concat_tables(parts) if parts else self.schema.empty_table()
            yield with_passthrough(table, rows.take(*index.rows_of(lo, hi)))
            self.bucket(i).unlink(missing_ok=True)


def bucket_parts(
    layout: OutputLayout,
    schema: pa.Schema,
    folder: Path,
    num_rows: int,
    rows_per_file: int,
    index: ResultIndex | None = None,
) -> StreamedResults:
    """Split the parts of ``layout`` into one bucket per results file under ``folder``;
    RuntimeError (nothing committed, parts kept) unless they hold each result exactly once:
    each of ``num_rows`` rows, or with ``index`` each of its results."""
    index = index or ResultIndex(num_rows)
    total = index.num_results
    out = StreamedResults(folder, schema, total, rows_per_file, index)
    seen = RowBits(total)
    where = f"parts kept in {layout.parts}"
    for t in _parts_in_reads(layout, schema):
        ids, samples = _keys(t)
        bad = ~index.valid(ids, samples)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            what = f"row {int(ids[i])}" + ("" if samples is None else f" sample {samples[i]}")
            raise RuntimeError(f"results hold {what} of {num_rows} rows; {where}")
        at = index.of(ids, samples)
        uniq, counts = np.unique(at, return_counts=True)
        twice = uniq[counts > 1]
        again = uniq[seen.has(uniq)]
        if len(twice) or len(again):
            first = int(np.concatenate([twice, again]).min())
            row = int(ids[np.flatnonzero(at == first)[0]])
            raise RuntimeError(f"row {row} is in the parts twice; {where}")
        seen.add(uniq)
        bucket = at // rows_per_file
        order = np.argsort(bucket, kind="stable")
        b = bucket[order]
        cuts = np.flatnonzero(np.diff(b)) + 1
        for idx in np.split(order, cuts):
            _append(out.bucket(int(bucket[idx[0]])), t.take(pa.array(idx)))
    if (have := seen.count()) != total:
        raise RuntimeError(f"results hold {have} rows for {total} expected; {where}")
    return out


class _Rows:
    """Rows ``[lo, hi)`` of a stream of tables with consecutive row ids, asked in order (a
    range may start at the last row of the one before: a row whose samples span two files)."""

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
        keep = max(hi - 1, lo)  # the range's last row may begin the next range
        rest = whole.slice(keep - self.start)
        self.buf, self.start = ([rest] if rest.num_rows else []), keep
        return out


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with the columns and types of ``schema`` (missing ones null), as the
    in-memory pass-through table has them (``PassthroughCollector``)."""
    if table.schema.equals(schema):
        return table
    both = pa.concat_tables([schema.empty_table(), table], promote_options="permissive")
    return both.select(schema.names).cast(schema)
