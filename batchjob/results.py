"""Results output: incremental, atomic, resumable.

Finished rows are buffered and flushed as numbered part files into ``<output>.parts/``, each
written atomically (temp file + rename). A job killed at any point leaves only whole parts;
rerun with the same arguments, it reads the row_ids already in the parts and skips them.
When every row is done, ``finalize`` joins the parts with the pass-through input columns,
sorts by row_id and writes the final file atomically, then removes the parts.

Exactly one result row per input row: the parts never hold a row twice (resumed runs skip
done rows), and ``finalize`` checks the count against the input before it commits.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io import ROW_ID, write_parquet_atomic

RESULT_SCHEMA = pa.schema(
    [
        (ROW_ID, pa.int64()),
        ("output_text", pa.string()),
        ("output_token_ids", pa.list_(pa.int32())),
        ("num_prompt_tokens", pa.int32()),
        ("num_output_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("status", pa.string()),
        ("message", pa.string()),
    ]
)


@dataclass(frozen=True)
class ResultRow:
    """The outcome of one input row."""

    row_id: int
    output_text: str | None
    output_token_ids: np.ndarray | None  # int32
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None  # "stop" | "length" | None (row not run)
    status: str  # "ok" or a per-row error code
    message: str | None


def output_file(path: str | Path) -> Path:
    """What marks a finished job: the results file, or ``_SUCCESS`` in a results directory."""
    p = Path(path)
    return p if p.suffix == ".parquet" else p / "_SUCCESS"


class ResultSink:
    """Buffers finished rows and flushes them as atomic part files.

    ``path`` ending in .parquet: one final file. Otherwise a directory of
    ``results-NNNNN.parquet`` files of ``rows_per_file`` rows each, then ``_SUCCESS``.
    """

    def __init__(
        self,
        path: str | Path,
        flush_rows: int = 4096,
        flush_seconds: float = 30.0,
        rows_per_file: int = 100_000,
    ):
        p = Path(path)
        self.single_file = p.suffix == ".parquet"
        self.final = output_file(p)
        self.parts_dir = p.with_name(p.name + ".parts") if self.single_file else p / "_parts"
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.rows_per_file = rows_per_file
        self._buffer: list[ResultRow] = []
        self._last_flush = time.monotonic()
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.parts_dir.glob("part-*.parquet"))
        self._next_part = 1 + max((int(p.stem.split("-")[1]) for p in existing), default=-1)

    def done_row_ids(self) -> np.ndarray:
        """row_ids already written by earlier (interrupted) runs."""
        parts = sorted(self.parts_dir.glob("part-*.parquet"))
        if not parts:
            return np.zeros(0, dtype=np.int64)
        cols = [pq.read_table(p, columns=[ROW_ID])[ROW_ID].to_numpy() for p in parts]
        return np.concatenate(cols).astype(np.int64)

    def add(self, row: ResultRow) -> None:
        self._buffer.append(row)
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        if len(self._buffer) >= self.flush_rows or due:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        rows = self._buffer
        table = pa.table(
            {
                ROW_ID: [r.row_id for r in rows],
                "output_text": [r.output_text for r in rows],
                "output_token_ids": [
                    None if r.output_token_ids is None else r.output_token_ids.tolist()
                    for r in rows
                ],
                "num_prompt_tokens": [r.num_prompt_tokens for r in rows],
                "num_output_tokens": [r.num_output_tokens for r in rows],
                "finish_reason": [r.finish_reason for r in rows],
                "status": [r.status for r in rows],
                "message": [r.message for r in rows],
            },
            schema=RESULT_SCHEMA,
        )
        write_parquet_atomic(table, self.parts_dir / f"part-{self._next_part:06d}.parquet")
        self._next_part += 1
        self._buffer = []
        self._last_flush = time.monotonic()

    def finalize(self, passthrough: pa.Table, expected_rows: int) -> Path:
        """Join parts with pass-through columns, write the final file, remove the parts."""
        self.flush()
        parts = sorted(self.parts_dir.glob("part-*.parquet"))
        results = (
            pa.concat_tables([pq.read_table(p, schema=RESULT_SCHEMA) for p in parts])
            if parts
            else RESULT_SCHEMA.empty_table()
        )
        ids = results[ROW_ID].to_numpy()
        if len(np.unique(ids)) != len(ids) or len(ids) != expected_rows:
            raise RuntimeError(
                f"results hold {len(ids)} rows ({len(np.unique(ids))} distinct) for "
                f"{expected_rows} input rows; parts kept in {self.parts_dir}"
            )
        extra = [c for c in passthrough.column_names if c != ROW_ID]
        clash = [c for c in extra if c in RESULT_SCHEMA.names]
        if clash:
            passthrough = passthrough.rename_columns(
                [f"input_{c}" if c in clash else c for c in passthrough.column_names]
            )
        results = results.sort_by(ROW_ID)
        if extra:
            # align pass-through rows to results by row_id (Arrow's join can't carry lists)
            pt_ids = passthrough[ROW_ID].to_numpy()
            order = np.argsort(pt_ids, kind="stable")
            pos = order[np.searchsorted(pt_ids, results[ROW_ID].to_numpy(), sorter=order)]
            taken = passthrough.take(pa.array(pos))
            for name in taken.column_names:
                if name != ROW_ID:
                    results = results.append_column(taken.schema.field(name), taken[name])
        if self.single_file:
            write_parquet_atomic(results, self.final)
        else:
            for i, start in enumerate(range(0, max(results.num_rows, 1), self.rows_per_file)):
                piece = results.slice(start, self.rows_per_file)
                write_parquet_atomic(piece, self.final.parent / f"results-{i:05d}.parquet")
            self.final.write_text(f"{results.num_rows} rows\n")
        shutil.rmtree(self.parts_dir, ignore_errors=True)
        return self.final if self.single_file else self.final.parent
