"""Results output: incremental, atomic, resumable, committed only when complete.

Finished rows are buffered and flushed as numbered part files into ``<meta>/parts/`` (see
``naming``), each written atomically (temp file + rename), the job's manifest first; the names
carry the run's token (``part-000003-<run>[-<worker>].parquet``). A job killed at any point
leaves only whole parts; rerun as the same job (same manifest), it reads the row_ids already in
the parts and skips them.

When every row is done, ``finalize`` joins the parts with the pass-through input columns,
sorts by row_id and commits; earlier results stay untouched until the new ones are whole:

- one local file: written in ``<meta>/staging/``, renamed over the old one;
- a local folder that is batchjob's alone: built whole in ``<meta>/staging/`` (files named
  ``results-NNNNN-<commit>.parquet`` + ``_SUCCESS``) and exchanged with the old folder in one
  ``renameat2(RENAME_EXCHANGE)``; without it, two renames (old to ``<meta>/previous/``, new
  into place) with the recovery rule of ``recovery.clean_stale``;
- an object-store folder, or a local folder shared with other files: in place, ``_SUCCESS``
  first removed and last written, new files under new names, batchjob's old files (listed in
  ``<meta>/commit.json`` while it runs) deleted only once every new one is written.

The committed manifest records the commit and its files; ``cleanup`` then removes the parts. A
crash anywhere from staging to cleanup leaves the parts and their manifest, so a rerun commits
again (rolls forward).

Exactly one result row per input row: the parts never hold a row twice within a run (resumed
runs skip done rows; a row two runs both wrote, a dead run's leftover worker's last part, is
kept once), and ``finalize`` checks the count against the input before it commits.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from uuid import uuid4

import numpy as np
import pyarrow as pa

from batchjob.config.sections import MAX_SAMPLES
from batchjob.inputs.parquet import ROW_ID
from batchjob.outputs.manifest import write_manifest
from batchjob.outputs.naming import COMMITTER, SUCCESS, OutputLayout, result_name
from batchjob.outputs.ownership import owned_results, swappable
from batchjob.outputs.score_columns import (
    OPTIONAL_COLUMNS,
    REASONING_TEXT,
    SAMPLE_INDEX,
    optional_columns,
)
from batchjob.storage.atomic import (
    atomic_open,
    fsync_dir,
    rename_exchange,
    write_json_atomic,
    write_parquet_atomic,
    write_text_atomic,
)
from batchjob.storage.faults import fault_point
from batchjob.storage.stores import ObjectPath
from batchjob.tokenize.prompts import request_keys

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
    """RESULT_SCHEMA plus the optional columns a job asks for (``score_columns``);
    ``sample_index`` (``sampling.n``) comes right after row_id, the key it completes, and
    ``reasoning_text`` (``output.reasoning_parser``) right before output_text."""
    fields = list(RESULT_SCHEMA)
    if REASONING_TEXT in extra_columns:
        fields.insert(1, pa.field(REASONING_TEXT, OPTIONAL_COLUMNS[REASONING_TEXT]))
    if SAMPLE_INDEX in extra_columns:
        fields.insert(1, pa.field(SAMPLE_INDEX, OPTIONAL_COLUMNS[SAMPLE_INDEX]))
    placed = (SAMPLE_INDEX, REASONING_TEXT)
    rest = [(c, OPTIONAL_COLUMNS[c]) for c in extra_columns if c not in placed]
    return pa.schema(fields + rest)


def result_keys(table: pa.Table) -> np.ndarray:
    """int64: the (row, sample) key of each result row (``request_keys``; a null or absent
    sample_index counts as sample 0)."""
    rows = table[ROW_ID].to_numpy()
    if SAMPLE_INDEX not in table.column_names:
        return request_keys(rows)
    samples = table[SAMPLE_INDEX].fill_null(0).to_numpy(zero_copy_only=False)
    return request_keys(rows, samples)


@dataclass(frozen=True)
class ResultRow:
    """The outcome of one request: an input row, or one sample of it (``sampling.n``)."""

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
    prompt_logprobs: Any = None  # (prompt token ids, TokenLogprobs) | None
    label_logprobs: np.ndarray | None = None  # float32 [L]
    label: str | None = None
    sample_index: int | None = None  # which sample of the row; None: the row was not sampled
    reasoning_text: str | None = None  # output.reasoning_parser: the <think> part
    embedding: np.ndarray | None = None  # float32 [D]: model.task = "embed"


class RowSink(Protocol):
    """Where ``batchjob.runner.execute`` puts every row's outcome: ``ResultSink`` (part files
    on disk, the job's results) or ``batchjob.outputs.memory.MemorySink`` (a table in memory,
    ``batchjob.generate``)."""

    def add(self, row: ResultRow) -> None: ...

    def flush(self) -> None: ...


def rows_table(rows: list[ResultRow], schema: pa.Schema) -> pa.Table:
    """Finished rows as a table of ``schema`` (``result_schema``), in the order given."""
    return pa.table(
        {
            ROW_ID: [r.row_id for r in rows],
            **(
                {SAMPLE_INDEX: pa.array([r.sample_index for r in rows], pa.int32())}
                if SAMPLE_INDEX in schema.names
                else {}
            ),
            "output_text": [r.output_text for r in rows],
            "output_token_ids": [
                None if r.output_token_ids is None else r.output_token_ids.tolist() for r in rows
            ],
            "num_prompt_tokens": [r.num_prompt_tokens for r in rows],
            "num_output_tokens": [r.num_output_tokens for r in rows],
            "finish_reason": [r.finish_reason for r in rows],
            "status": [r.status for r in rows],
            "message": [r.message for r in rows],
            **optional_columns(rows, schema),
        },
        schema=schema,
    )


def with_passthrough(results: pa.Table, passthrough: pa.Table) -> pa.Table:
    """``results`` (one row per row_id, or per sample) sorted by row_id (then sample_index),
    the input's pass-through columns appended (repeated for each sample of a row); an input
    column named like a result column is kept as ``input_<name>``."""
    extra = [c for c in passthrough.column_names if c != ROW_ID]
    clash = [c for c in extra if c in results.column_names]
    if clash:
        passthrough = passthrough.rename_columns(
            [f"input_{c}" if c in clash else c for c in passthrough.column_names]
        )
    keys = [(ROW_ID, "ascending")]
    if SAMPLE_INDEX in results.column_names:
        keys.append((SAMPLE_INDEX, "ascending"))
    results = results.sort_by(keys)
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


class ResultSink:
    """Buffers finished rows and flushes them as atomic part files.

    Single-file layout: one final file. Otherwise a folder of ``results-NNNNN-<commit>.parquet``
    files of ``rows_per_file`` rows each, then ``_SUCCESS``.

    ``run``: the run's token (in every part name, so a run never writes a name a dead run's
    leftover worker could write too; default: a new one). ``writer``: a cluster worker's id,
    also in the names. ``before_write``: called before each part file (a cluster worker's
    check that its run still holds the output; it raises to stop). ``own_parts_dir`` False:
    never create the parts folder (a worker whose run was committed meanwhile must not).
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
        run: str = "",
        before_write: Callable[[], None] | None = None,
        own_parts_dir: bool = True,
    ):
        self.schema = result_schema(extra_columns)
        self.run = run or uuid4().hex[:8]
        # part-<N>-<run>[-<writer>].parquet: no two runs, no two writers share a name
        self._suffix = f"-{self.run}" + (f"-{writer}" if writer else "")
        self.layout = layout
        self.store = layout.store
        self.manifest = manifest
        self.parts_dir = layout.parts
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.rows_per_file = rows_per_file
        self.before_write = before_write
        self.own_parts_dir = own_parts_dir
        self._buffer: list[ResultRow] = []
        self._last_flush = time.monotonic()
        if own_parts_dir:
            self.store.mkdir(self.parts_dir)
        existing = layout.part_files()
        self._next_part = 1 + max((int(p.stem.split("-")[1]) for p in existing), default=-1)

    def done_keys(self) -> np.ndarray:
        """The result keys (``result_keys``) already written by earlier (interrupted) runs of
        the same job."""
        parts = self.layout.part_files()
        if not parts:
            return np.zeros(0, dtype=np.int64)
        cols = [ROW_ID] + ([SAMPLE_INDEX] if SAMPLE_INDEX in self.schema.names else [])
        keys = [result_keys(self.store.read_parquet(p, columns=cols)) for p in parts]
        return np.unique(np.concatenate(keys))

    def add(self, row: ResultRow) -> None:
        self._buffer.append(row)
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        if len(self._buffer) >= self.flush_rows or due:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        if self.before_write is not None:
            self.before_write()
        if not self.store.exists(self.layout.parts_manifest):  # the job's identity, first
            write_manifest(self.manifest, self.layout.parts_manifest)
            fault_point("manifest")
        table = rows_table(self._buffer, self.schema)
        fault_point("part")
        name = f"part-{self._next_part:06d}{self._suffix}.parquet"
        write_parquet_atomic(table, self.parts_dir / name, make_parent=self.own_parts_dir)
        self._next_part += 1
        self._buffer = []
        self._last_flush = time.monotonic()

    def finalize(self, passthrough: pa.Table, expected_rows: int) -> Path | ObjectPath:
        # expected_rows: result rows the job has (``execute.expected_results``)
        """Join parts with pass-through columns, then commit: the new results replace the old
        ones in one step where the layout allows it (see the module doc)."""
        self.flush()
        results = self._joined(passthrough, expected_rows)
        if self.layout.single_file:
            return self._commit([results], results.num_rows)
        step = self.rows_per_file
        files = (results.slice(s, step) for s in range(0, max(results.num_rows, 1), step))
        return self._commit(files, results.num_rows)

    def commit_chunks(self, chunks: Iterable[pa.Table], rows: int) -> Path | ObjectPath:
        """Commit results given as tables in row_id order (``streamed_commit``: one at a
        time, never the whole): each of ``rows_per_file`` rows (the last fewer, at least
        one table), a results file each, or row groups of the one file. The caller checked
        them: ``rows`` rows, one per result key."""
        self.flush()
        return self._commit(chunks, rows)

    def _commit(self, chunks: Iterable[pa.Table], rows: int) -> Path | ObjectPath:
        layout = self.layout
        if layout.single_file:
            if layout.remote:
                self._commit_object(chunks, rows)
            else:
                self._commit_file(chunks, rows)
        elif swappable(layout):
            self._commit_swap(chunks, rows)
        else:
            self._commit_in_place(chunks, rows)
        return layout.output

    def _joined(self, passthrough: pa.Table, expected_rows: int) -> pa.Table:
        parts = self.layout.part_files()
        tables = [self.store.read_parquet(p, schema=self.schema) for p in parts]
        results = pa.concat_tables(tables) if parts else self.schema.empty_table()
        keys = result_keys(results)
        if len(np.unique(keys)) != len(keys):
            results = _drop_dead_runs_copies(results, parts, tables, self.parts_dir)
        if results.num_rows != expected_rows:
            raise RuntimeError(
                f"results hold {results.num_rows} rows for {expected_rows} expected; parts kept "
                f"in {self.parts_dir}"
            )
        return with_passthrough(results, passthrough)

    def _names(self, rows: int, commit: str) -> list[str]:
        """The results files of a folder output of ``rows`` rows (``rows_per_file`` each)."""
        return [result_name(i, commit) for i in range(max(-(-rows // self.rows_per_file), 1))]

    def _commit_id(self) -> str:
        """A new commit id: no file of it can have a name the results folder holds now."""
        present = (
            set(self.store.names(self.layout.output)) if not self.layout.single_file else set()
        )
        while True:
            commit = uuid4().hex[:8]
            if not any(commit in n for n in present):
                return commit

    def _committed(self, commit: str | None, files: list[str], rows: int) -> dict[str, Any]:
        """The manifest of committed results: the job's + what was committed."""
        return {**self.manifest, "results": {"commit": commit, "files": files, "rows": rows}}

    def _commit_file(self, chunks: Iterable[pa.Table], rows: int) -> None:
        """One results file: staged in the metadata folder, then renamed over the old one."""
        layout = self.layout
        assert isinstance(layout.output, Path) and isinstance(layout.staging, Path)
        shutil.rmtree(layout.staging, ignore_errors=True)
        staged = layout.staging / layout.output.name
        _write_chunks(chunks, staged)
        fault_point("stage")
        layout.manifest_file.unlink(missing_ok=True)  # the old results lose their voucher
        fault_point("commit")
        layout.output.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, layout.output)
        fsync_dir(layout.output.parent)
        write_manifest(self._committed(None, [layout.output.name], rows), layout.manifest_file)
        fault_point("committed")
        shutil.rmtree(layout.staging, ignore_errors=True)

    def _commit_swap(self, chunks: Iterable[pa.Table], rows: int) -> None:
        """A local results folder that is batchjob's alone: the new folder is built whole in
        ``<meta>/staging/`` (files + ``_SUCCESS``) and exchanged with the old folder in one
        ``renameat2(RENAME_EXCHANGE)``: a reader sees the old folder or the new one, at every
        instant. Without that call (an old kernel, a filesystem without it): the old folder is
        renamed to ``<meta>/previous/`` and the new one into place, two renames; a kill between
        them leaves no results folder for that instant, and the rerun moves the old one back
        (``recovery.clean_stale``) before it commits again. Never a mix."""
        layout = self.layout
        out, staging = layout.output, layout.staging
        assert isinstance(out, Path) and isinstance(staging, Path)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        commit = self._commit_id()
        names = self._names(rows, commit)
        for name, table in zip(names, chunks, strict=True):
            write_parquet_atomic(table, staging / name)
            fault_point("stage")
        write_json_atomic(_success(commit, rows, names), staging / SUCCESS)
        layout.manifest_file.unlink(missing_ok=True)  # the old results lose their voucher
        fault_point("commit")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            os.chmod(staging, stat.S_IMODE(out.stat().st_mode))  # the folder keeps its mode
            if rename_exchange(staging, out):
                fault_point("swap")
            else:
                os.rename(out, layout.previous)
                fault_point("swap")
                os.rename(staging, out)
                fault_point("swap")
        else:
            os.rename(staging, out)
            fault_point("swap")
        fsync_dir(out.parent)
        write_manifest(self._committed(commit, names, rows), layout.manifest_file)
        fault_point("committed")
        shutil.rmtree(staging, ignore_errors=True)  # the old folder, after an exchange
        shutil.rmtree(layout.previous, ignore_errors=True)

    def _commit_object(self, chunks: Iterable[pa.Table], rows: int) -> None:
        """One results object on an object store: one atomic PUT over the old one."""
        layout = self.layout
        self.store.delete(layout.manifest_file)
        fault_point("commit")
        _write_chunks(chunks, layout.output)
        fault_point("commit_file")
        write_manifest(self._committed(None, [layout.output.name], rows), layout.manifest_file)
        fault_point("committed")

    def _commit_in_place(self, chunks: Iterable[pa.Table], rows: int) -> None:
        """A folder that cannot be swapped: on an object store (no rename), or a local folder
        shared with files batchjob did not write (``output.allow_other_files``). ``_SUCCESS``
        goes first (readers: incomplete from here), the new files are written under names no
        old file has, then batchjob's old files are deleted (only those: the commit log names
        them, so a kill anywhere leaves nothing unaccounted for), the manifest and ``_SUCCESS``
        last. Until every new file is written no old file is changed or deleted."""
        layout, store, out = self.layout, self.store, self.layout.output
        old = owned_results(layout) - {SUCCESS}
        commit = self._commit_id()
        names = self._names(rows, commit)
        store.delete(layout.manifest_file)
        fault_point("commit")
        log = {"commit": commit, "files": names, "replaces": sorted(old)}
        write_json_atomic(log, layout.commit_log)
        store.delete(out / SUCCESS)  # readers: incomplete from here until the end
        store.mkdir(out)
        for name, table in zip(names, chunks, strict=True):
            write_parquet_atomic(table, out / name)
            fault_point("commit_file")
        for name in sorted(old - set(names)):
            store.delete(out / name)  # batchjob's earlier files, and only those
        write_manifest(self._committed(commit, names, rows), layout.manifest_file)
        write_json_atomic(_success(commit, rows, names), out / SUCCESS)
        store.delete(layout.commit_log)
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


def _write_chunks(chunks: Iterable[pa.Table], path: Any) -> None:
    """One Parquet file of ``chunks`` (at least one; one table: as ``write_parquet_atomic``
    writes it), written atomically."""
    import pyarrow.parquet as pq

    it = iter(chunks)
    first = next(it)
    with atomic_open(path, "wb") as f, pq.ParquetWriter(f, first.schema) as w:
        w.write_table(first)
        for table in it:
            w.write_table(table)


def _success(commit: str, rows: int, files: list[str]) -> dict[str, Any]:
    """``_SUCCESS`` of a results folder: batchjob's commit, its rows and files (a reader that
    reads exactly these files reads one whole commit)."""
    return {"committer": COMMITTER, "commit": commit, "rows": rows, "files": files}


def _part_run(part: Any) -> str:
    """The run token in a part's name (part-<N>-<run>[-<writer>]); "" for older names."""
    bits = part.stem.split("-")
    return bits[2] if len(bits) > 2 and len(bits[2]) == 8 else ""


def _drop_dead_runs_copies(
    results: pa.Table, parts: list[Any], tables: list[pa.Table], parts_dir: Any
) -> pa.Table:
    """Rows that two runs of the same job both wrote (a dead run's cluster worker that wrote
    one more part before it noticed the new run): every copy is a result of this job, the
    first is kept. Twice within one run is a bug: RuntimeError."""
    runs = (
        np.concatenate([np.full(t.num_rows, i, dtype=np.int64) for i, t in enumerate(tables)])
        if tables
        else np.zeros(0, dtype=np.int64)
    )
    run_of_part = [_part_run(p) for p in parts]
    ids = result_keys(results)
    order = np.lexsort((runs, ids))
    sids, sparts = ids[order], runs[order]
    dup = np.flatnonzero(sids[1:] == sids[:-1]) + 1
    for i in dup:
        a, b = run_of_part[sparts[i - 1]], run_of_part[sparts[i]]
        if not a or a == b:
            raise RuntimeError(
                f"row {int(sids[i]) // MAX_SAMPLES} is in two part files of one run "
                f"({parts[sparts[i - 1]].name}, {parts[sparts[i]].name}); parts kept in "
                f"{parts_dir}"
            )
    keep = np.ones(len(ids), dtype=bool)
    keep[order[dup]] = False
    return results.filter(pa.array(keep))
