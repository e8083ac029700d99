"""Results output: incremental, atomic, resumable, committed only when complete.

Finished rows are buffered and flushed as numbered part files into ``<meta>/parts/`` (see
``output_layout``), each written atomically (temp file + rename), the job's manifest first.
A job killed at any point leaves only whole parts; rerun as the same job (same manifest), it
reads the row_ids already in the parts and skips them.

When every row is done, ``finalize`` joins the parts with the pass-through input columns,
sorts by row_id and writes the final files into ``<meta>/staging/``; ``commit`` then moves
them over the output (earlier results stay untouched until this point) and records the
manifest beside them; ``cleanup`` removes the parts. A crash anywhere from staging to
cleanup leaves the parts and their manifest, so a rerun commits again (rolls forward).

On an object store (``layout.remote``; batchjob.storage.stores) there is no rename: every part is
one PUT under a unique name (a random token per run), and the commit writes the final files in
place after removing ``_SUCCESS`` and the committed manifest, then the manifest and ``_SUCCESS``
last; a reader treats a folder without ``_SUCCESS`` as incomplete. A crash during the commit
leaves the parts, so the rerun commits again, as locally.

Exactly one result row per input row: the parts never hold a row twice (resumed runs skip
done rows), and ``finalize`` checks the count against the input before it commits.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pyarrow as pa

from batchjob.inputs.parquet import ROW_ID
from batchjob.outputs.layout import RESULT_GLOB, SUCCESS, OutputLayout
from batchjob.outputs.manifest import write_manifest
from batchjob.outputs.score_columns import OPTIONAL_COLUMNS, optional_columns
from batchjob.storage.atomic import fsync_dir, write_parquet_atomic, write_text_atomic
from batchjob.storage.faults import fault_point
from batchjob.storage.stores import ObjectPath

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


def result_schema(extra_columns: tuple[str, ...] = ()) -> pa.Schema:
    """RESULT_SCHEMA plus the optional columns a job asks for (``score_columns``)."""
    return pa.schema(list(RESULT_SCHEMA) + [(c, OPTIONAL_COLUMNS[c]) for c in extra_columns])


_LEGACY_META = (
    "report.json",
    "report.iterations.parquet",
    "report.summary.parquet",
    "report.timeline.png",
    "plan.parquet",
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
    # optional columns (batchjob.outputs.score_columns), written when the job asks for them
    output_logprobs: Any = None  # TokenLogprobs | None
    label_logprobs: np.ndarray | None = None  # float32 [L]
    label: str | None = None


class ResultSink:
    """Buffers finished rows and flushes them as atomic part files.

    Single-file layout: one final file. Otherwise a folder of ``results-NNNNN.parquet`` files
    of ``rows_per_file`` rows each, then ``_SUCCESS``.
    """

    def __init__(
        self,
        layout: OutputLayout,
        manifest: dict[str, Any],
        flush_rows: int = 4096,
        flush_seconds: float = 30.0,
        rows_per_file: int = 100_000,
        extra_columns: tuple[str, ...] = (),
        writer: str = "",
    ):
        self.schema = result_schema(extra_columns)
        # parts of concurrent writers (cluster workers) get the writer's id in their names
        self._suffix = f"-{writer}" if writer else ""
        if layout.remote:  # no atomic rename: unique names keep any two writers apart
            self._suffix += f"-{uuid4().hex[:12]}"
        self.layout = layout
        self.store = layout.store
        self.manifest = manifest
        self.parts_dir = layout.parts
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.rows_per_file = rows_per_file
        self._buffer: list[ResultRow] = []
        self._last_flush = time.monotonic()
        self.store.mkdir(self.parts_dir)
        existing = layout.part_files()
        self._next_part = 1 + max((int(p.stem.split("-")[1]) for p in existing), default=-1)

    def done_row_ids(self) -> np.ndarray:
        """row_ids already written by earlier (interrupted) runs of the same job."""
        parts = self.layout.part_files()
        if not parts:
            return np.zeros(0, dtype=np.int64)
        cols = [self.store.read_parquet(p, columns=[ROW_ID])[ROW_ID].to_numpy() for p in parts]
        return np.concatenate(cols).astype(np.int64)

    def add(self, row: ResultRow) -> None:
        self._buffer.append(row)
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        if len(self._buffer) >= self.flush_rows or due:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        if not self.store.exists(self.layout.parts_manifest):  # the job's identity, first
            write_manifest(self.manifest, self.layout.parts_manifest)
            fault_point("manifest")
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
                **optional_columns(rows, self.schema),
            },
            schema=self.schema,
        )
        fault_point("part")
        name = f"part-{self._next_part:06d}{self._suffix}.parquet"
        write_parquet_atomic(table, self.parts_dir / name)
        self._next_part += 1
        self._buffer = []
        self._last_flush = time.monotonic()

    def finalize(self, passthrough: pa.Table, expected_rows: int) -> Path | ObjectPath:
        """Join parts with pass-through columns, stage the final files, commit them."""
        self.flush()
        results = self._joined(passthrough, expected_rows)
        if self.layout.remote:
            self._commit_in_place(results)
            return self.layout.output
        staged = self._stage(results)
        self._commit(staged)
        return self.layout.output

    def _joined(self, passthrough: pa.Table, expected_rows: int) -> pa.Table:
        parts = self.layout.part_files()
        results = (
            pa.concat_tables([self.store.read_parquet(p, schema=self.schema) for p in parts])
            if parts
            else self.schema.empty_table()
        )
        ids = results[ROW_ID].to_numpy()
        if len(np.unique(ids)) != len(ids) or len(ids) != expected_rows:
            raise RuntimeError(
                f"results hold {len(ids)} rows ({len(np.unique(ids))} distinct) for "
                f"{expected_rows} input rows; parts kept in {self.parts_dir}"
            )
        extra = [c for c in passthrough.column_names if c != ROW_ID]
        clash = [c for c in extra if c in self.schema.names]
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
        return results

    def _stage(self, results: pa.Table) -> list[Path]:
        """Write the final files into staging/; nothing at the output changes yet."""
        staging = self.layout.staging
        shutil.rmtree(staging, ignore_errors=True)
        if self.layout.single_file:
            files = [staging / self.layout.output.name]
            write_parquet_atomic(results, files[0])
            fault_point("stage")
            return files
        files = []
        for i, start in enumerate(range(0, max(results.num_rows, 1), self.rows_per_file)):
            files.append(staging / f"results-{i:05d}.parquet")
            write_parquet_atomic(results.slice(start, self.rows_per_file), files[-1])
            fault_point("stage")
        write_text_atomic(f"{results.num_rows} rows\n", staging / SUCCESS)
        return files

    def _commit(self, staged: list[Path]) -> None:
        """Swap the staged files in, then record the manifest of what is now committed."""
        layout = self.layout
        assert isinstance(layout.output, Path)  # local (an object store: _commit_in_place)
        layout.manifest_file.unlink(missing_ok=True)  # the old results lose their voucher
        fault_point("commit")
        if layout.single_file:
            layout.output.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged[0], layout.output)
            fsync_dir(layout.output.parent)
        else:
            out = layout.output
            out.mkdir(parents=True, exist_ok=True)
            (out / SUCCESS).unlink(missing_ok=True)
            names = {f.name for f in staged}
            for f in staged:
                os.replace(f, out / f.name)
                fault_point("commit_file")
            for old in out.glob(RESULT_GLOB):
                if old.name not in names:
                    old.unlink()  # a previous, longer run's extra files
            for name in _LEGACY_META:  # metadata that older versions wrote into the folder
                (out / name).unlink(missing_ok=True)
            shutil.rmtree(out / "_parts", ignore_errors=True)
            fsync_dir(out)
            os.replace(layout.staging / SUCCESS, out / SUCCESS)
            fsync_dir(out)
        write_manifest(self.manifest, layout.manifest_file)
        fault_point("committed")
        shutil.rmtree(layout.staging, ignore_errors=True)

    def _commit_in_place(self, results: pa.Table) -> None:
        """The commit on an object store (no rename): the old results lose their voucher
        (manifest, ``_SUCCESS``), the new files are PUT over them, stale ones deleted, then the
        manifest and ``_SUCCESS`` are written last. One results object is one atomic PUT."""
        layout, store, out = self.layout, self.store, self.layout.output
        store.delete(layout.manifest_file)
        fault_point("commit")
        if layout.single_file:
            write_parquet_atomic(results, out)
            fault_point("commit_file")
        else:
            store.delete(out / SUCCESS)  # readers: incomplete from here until the end
            names = set()
            for i, start in enumerate(range(0, max(results.num_rows, 1), self.rows_per_file)):
                names.add(f"results-{i:05d}.parquet")
                write_parquet_atomic(
                    results.slice(start, self.rows_per_file), out / f"results-{i:05d}.parquet"
                )
                fault_point("commit_file")
            for old in store.glob(out, RESULT_GLOB):
                if old.name not in names:
                    store.delete(old)  # a previous, longer run's extra files
        write_manifest(self.manifest, layout.manifest_file)
        if not layout.single_file:
            write_text_atomic(f"{results.num_rows} rows\n", out / SUCCESS)
        fault_point("committed")

    def cleanup(self) -> None:
        """Remove the parts of a committed job: renamed away first (one atomic step), then
        deleted, so a kill leaves either the whole parts folder or none of it. On an object
        store (no rename) a ``_CLEANUP`` marker is written into the parts folder first: a kill
        during the deletes leaves it, and the rerun finishes the deletion (``clean_stale``)."""
        layout = self.layout
        if layout.remote:
            write_text_atomic("parts of committed results: delete\n", layout.cleanup_marker)
            for p in layout.part_files():
                self.store.delete(p)
                fault_point("cleanup")
            self.store.delete_tree(layout.parts)
            return
        if not layout.parts.exists():
            return
        shutil.rmtree(layout.trash, ignore_errors=True)
        os.replace(layout.parts, layout.trash)
        fault_point("cleanup")
        shutil.rmtree(layout.trash, ignore_errors=True)
