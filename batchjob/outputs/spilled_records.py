"""What a partitioned run records per row or per iteration, spilled to disk as it comes.

A run over ``scheduler.plan_memory`` holds one partition at a time; these two hold the rest
of what grows with the dataset in a few KiB plus one buffer:

- ``RejectedSpill``: the rows rejected while reading (row id, status, message), appended to
  a Parquet file in batches; in memory only the counts per status and the first message.
- ``IterationLog``: every engine iteration's record, appended to a Parquet file in batches
  with the iterations numbered on across partitions; in memory only the totals the report
  needs (count, tokens, minimum, engine and TECD seconds).

Each is read back in batches (``RejectedSpill.chunks``, ``IterationLog.write``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.backends.base import IterationRecord
from batchjob.inputs.parquet import ROW_ID, RejectedRows
from batchjob.storage.atomic import Target, atomic_open
from batchjob.storage.workdir import owned_workdir

BATCH_ROWS = 8192  # records buffered (as Python objects) before a row group is written


class RejectedSpill:
    """Rejected rows appended to ``<folder>/rejected.parquet`` in row groups of ``batch``."""

    SCHEMA = pa.schema([(ROW_ID, pa.int64()), ("status", pa.string()), ("message", pa.string())])

    def __init__(self, folder: Path, batch: int = BATCH_ROWS):
        self.path = folder / "rejected.parquet"
        self.batch = batch
        self._buf: list[pa.Table] = []
        self._buffered = 0
        self._writer: pq.ParquetWriter | None = None
        self._counts: dict[str, int] = {}
        self._n = 0
        self._first: tuple[int, str] | None = None  # (row id, message) of the lowest row id

    def __len__(self) -> int:
        return self._n

    def counts(self) -> dict[str, int]:
        """{status: number of rows}, as ``RejectedRows.counts``."""
        return dict(self._counts)

    @property
    def first_message(self) -> str:
        """The message of the lowest row id rejected ("" when none)."""
        return self._first[1] if self._first else ""

    def add(self, rejected: RejectedRows) -> None:
        if not len(rejected):
            return
        for s in rejected.status:
            self._counts[s] = self._counts.get(s, 0) + 1
        self._n += len(rejected)
        i = int(np.argmin(rejected.row_ids))
        if self._first is None or int(rejected.row_ids[i]) < self._first[0]:
            self._first = (int(rejected.row_ids[i]), rejected.message[i])
        self._buf.append(rejected.to_arrow().cast(self.SCHEMA))
        self._buffered += len(rejected)
        if self._buffered >= self.batch:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, self.SCHEMA)
        self._writer.write_table(pa.concat_tables(self._buf))
        self._buf, self._buffered = [], 0

    def chunks(self) -> Iterator[RejectedRows]:
        """The rows in the order added, a row group (or the buffer) at a time; after the
        last ``add``."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            f = pq.ParquetFile(self.path)
            for g in range(f.num_row_groups):
                yield _rejected_of(f.read_row_group(g))
        for t in self._buf:
            yield _rejected_of(t)


def _rejected_of(t: pa.Table) -> RejectedRows:
    return RejectedRows(
        t[ROW_ID].to_numpy().astype(np.int64),
        tuple(t["status"].to_pylist()),
        tuple(t["message"].to_pylist()),
    )


_FIELDS = [f.name for f in dataclasses.fields(IterationRecord)]
_INTS = [f for f in _FIELDS if f != "wall_s"]
ITERATION_SCHEMA = pa.schema([(f, pa.float64() if f == "wall_s" else pa.int64()) for f in _FIELDS])


class IterationLog:
    """Engine iterations appended to a Parquet file in a work folder this process owns
    (``<parent>/.iterations-*``, removed by ``close``; a killed run's by the next one).

    ``add`` renumbers each run's records on from the last: ``iteration`` counts the job's
    iterations, partition after partition. The totals match ``report.summarize`` over the
    same records so numbered (TECD: the wall time through the last iteration carrying
    prefill tokens)."""

    def __init__(self, parent: Path, batch: int = BATCH_ROWS):
        self._stack = ExitStack()
        self.folder = self._stack.enter_context(owned_workdir(parent, ".iterations-"))
        self.path = self.folder / "iterations.parquet"
        self.batch = batch
        self._cols: dict[str, list] = {f: [] for f in _FIELDS}
        self._writer: pq.ParquetWriter | None = None
        self.count = 0
        self.tokens = 0  # decode + prefill tokens over all iterations
        self.min_tokens = 0
        self.wall_s = 0.0
        self.tecd_s = 0.0

    def add(self, records: list[IterationRecord]) -> None:
        base = self.count
        for k, r in enumerate(records):
            tokens = r.decode_tokens + r.prefill_tokens
            self.min_tokens = tokens if self.count == 0 else min(self.min_tokens, tokens)
            self.tokens += tokens
            self.wall_s += r.wall_s
            if r.prefill_tokens > 0:
                self.tecd_s = self.wall_s
            self.count += 1
            self._cols["iteration"].append(base + k)
            for f in _FIELDS[1:]:
                self._cols[f].append(getattr(r, f))
            if len(self._cols["iteration"]) >= self.batch:
                self._flush()

    @property
    def mean_tokens(self) -> float:
        return self.tokens / self.count if self.count else 0.0

    def _flush(self) -> None:
        if not self._cols["iteration"]:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, ITERATION_SCHEMA)
        self._writer.write_table(pa.table(self._cols, schema=ITERATION_SCHEMA))
        self._cols = {f: [] for f in _FIELDS}

    def tables(self) -> Iterator[pa.Table]:
        """The records in order, a row group at a time."""
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.path.exists():
            f = pq.ParquetFile(self.path)
            for g in range(f.num_row_groups):
                yield f.read_row_group(g)

    def write(self, target: Target) -> None:
        """The report's iterations Parquet: every record, written a row group at a time."""
        with atomic_open(target, "wb") as f, pq.ParquetWriter(f, ITERATION_SCHEMA) as w:
            for t in self.tables():
                w.write_table(t)
            if self.count == 0:
                w.write_table(ITERATION_SCHEMA.empty_table())

    def columns(self, names: list[str]) -> dict[str, np.ndarray]:
        """``names`` over all records as arrays (the timeline plot's three columns)."""
        parts = [t.select(names) for t in self.tables()]
        if not parts:
            return {n: np.zeros(0, np.int64) for n in names}
        t = pa.concat_tables(parts)
        return {n: t[n].to_numpy() for n in names}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._stack.close()
