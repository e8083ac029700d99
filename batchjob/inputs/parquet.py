"""Parquet input, streamed with pyarrow.dataset (output is written by batchjob.storage.atomic).

``input.path`` may be an object-store URI (``s3://bucket/prefix/``, a URI glob): files are
listed and read through the job's filesystem (batchjob.storage.stores) and named by their URIs.

Row ids: every row's ``row_id`` is its global index in the dataset, files taken in sorted
path order, so the same input gives the same ids on every run (resume relies on it).

Dataset-level problems (nothing matches, missing or mistyped column, corrupt file, no rows)
raise ``InputDataError``. Per-row problems do not abort the job: the row is rejected with a
status code (``empty_prompt``, ``prompt_too_long``, ``invalid_tokens``, ``invalid_max_tokens``)
and reported in ``RejectedRows`` so that the writer still emits one result row for it.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import InputConfig, ModelConfig
from batchjob.errors import InputDataError, one_line
from batchjob.inputs.prompt_builder import PromptBuilder, make_builder
from batchjob.storage.stores import ObjectPath, arrow_source, is_uri, list_files

ROW_ID = "row_id"


def _is_text(t: pa.DataType) -> bool:
    """string / large_string, or a dictionary of them (a pandas categorical column)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_token_list(t: pa.DataType) -> bool:
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return is_list and pa.types.is_integer(t.value_type)


# ---------------------------------------------------------------------------------------
# typed results


@dataclass(frozen=True)
class PromptBatch:
    """One streamed batch of rows, all from one file."""

    row_ids: np.ndarray  # int64 [B]: global row ids (consecutive)
    prompts: pa.Array  # [B] string/large_string, or list<int> token ids
    max_tokens: np.ndarray | None  # int64 [B] per-row limit; None: no such column
    max_tokens_null: np.ndarray | None  # bool [B]: the row's limit is null (use the default)
    passthrough: pa.Table  # [B] row_id + every input column except the prompt column
    source: str  # file path the rows come from
    file_row_start: int  # index of the first row within that file
    add_special_tokens: bool = True  # False: chat text that holds its BOS/EOS already
    rejected: RejectedRows | None = None  # rows the prompt builder rejected (prompt null)

    def __len__(self) -> int:
        return len(self.row_ids)

    def where(self, i: int) -> str:
        """Human location of batch row ``i``: 'row 17 (file a.parquet, row 5)'."""
        return (
            f"row {int(self.row_ids[i])} "
            f"(file {os.path.basename(self.source)}, row {self.file_row_start + i})"
        )


@dataclass(frozen=True)
class RejectedRows:
    """Rows excluded from planning, with why. The writer emits one result row for each."""

    row_ids: np.ndarray  # int64 [R]
    status: tuple[str, ...]  # [R] status code per row (STATUS_*)
    message: tuple[str, ...]  # [R] human message naming row, file and column

    def __len__(self) -> int:
        return len(self.row_ids)

    @classmethod
    def empty(cls) -> RejectedRows:
        return cls(np.zeros(0, dtype=np.int64), (), ())

    @classmethod
    def concat(cls, parts: list[RejectedRows]) -> RejectedRows:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        ids = np.concatenate([p.row_ids for p in parts]).astype(np.int64)
        status = tuple(s for p in parts for s in p.status)
        message = tuple(m for p in parts for m in p.message)
        order = np.argsort(ids, kind="stable")
        return cls(ids[order], tuple(status[i] for i in order), tuple(message[i] for i in order))

    def counts(self) -> dict[str, int]:
        """{status: number of rows}."""
        out: dict[str, int] = {}
        for s in self.status:
            out[s] = out.get(s, 0) + 1
        return out

    def to_arrow(self) -> pa.Table:
        return pa.table(
            {
                ROW_ID: pa.array(self.row_ids, pa.int64()),
                "status": pa.array(self.status, pa.string()),
                "message": pa.array(self.message, pa.string()),
            }
        )


class PassthroughCollector:
    """Accumulates the pass-through columns of every batch, as Arrow, for the writer."""

    def __init__(self) -> None:
        self._tables: list[pa.Table] = []

    def add(self, batch: PromptBatch) -> None:
        self._tables.append(batch.passthrough)

    def table(self) -> pa.Table:
        """All pass-through rows in row_id order (schemas unified across files)."""
        if not self._tables:
            return pa.table({ROW_ID: pa.array([], pa.int64())})
        return pa.concat_tables(self._tables, promote_options="permissive").combine_chunks()


# ---------------------------------------------------------------------------------------
# the dataset


def resolve_files(path: str) -> list[str]:
    """A file, a directory (every *.parquet below it) or a glob -> sorted file paths, each
    real file once: links are followed, but a folder is entered once however many links lead
    to it (``ln -s . loop`` lists nothing twice) and a file reached by two paths is listed
    under one of them (its own path over a link's)."""
    if is_uri(path):
        return _resolve_uri(path)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found = [f for f in _walk_local(path) if f.endswith(".parquet")]
    else:
        found = []
        for m in _glob_local(path):
            if os.path.isdir(m):
                found += [f for f in _walk_local(m) if f.endswith(".parquet")]
            else:
                found.append(m)
    broken = [f for f in found if os.path.islink(f) and not os.path.exists(f)]
    if broken := [f for f in broken if not _hidden(f, path)]:
        raise InputDataError(
            f"{broken[0]}: a link to {os.readlink(broken[0])}, which does not exist "
            f"(input.path {path!r}); its rows would be missing: fix or remove the link"
        )
    files = _one_path_per_file({f for f in found if os.path.isfile(f) and not _hidden(f, path)})
    if not files:
        raise InputDataError(f"input.path: {path!r} matches no Parquet file")
    return files


def _walk_local(root: str) -> list[str]:
    """Every file and folder below ``root`` (not ``root`` itself), links to folders followed
    but each real folder entered once: a link back up the tree (``ln -s . loop``) or two links
    to one folder list its files once. Folders reached without a link are walked before any
    link is followed, so a file keeps its own path when a link also reaches it. Hidden names
    (``.``) are not entered, as glob does not."""
    out: list[str] = []
    seen: set[tuple[int, int]] = set()
    plain: list[str] = [root]
    linked: list[str] = []
    while plain or linked:
        folder = plain.pop() if plain else linked.pop()
        try:
            st = os.stat(folder)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            out.append(e.path)
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                (linked if e.is_symlink() else plain).append(e.path)
    return out


def _glob_local(pattern: str) -> list[str]:
    """glob.glob(pattern), ``**`` matching any number of folders; a ``**`` pattern is matched
    over ``_walk_local`` (glob's own ``**`` follows a link loop down to the kernel's limit)."""
    if "**" not in pattern:
        return glob.glob(pattern)
    parts = pattern.split(os.sep)
    fixed = next(i for i, s in enumerate(parts) if glob.has_magic(s))
    root = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else ".")
    if not os.path.isdir(root):
        return []
    prefix = "" if fixed == 0 else os.path.join(root, "")
    out = []
    for f in _walk_local(root):
        rel = f[len(prefix) :] if prefix else os.path.relpath(f, root)
        if _match_parts(rel.split(os.sep), parts[fixed:]):
            out.append(f)
    return out


def _match_parts(names: list[str], pats: list[str]) -> bool:
    """Path components against glob components (``**``: zero or more components)."""
    if not pats:
        return not names
    if pats[0] == "**":
        return any(_match_parts(names[i:], pats[1:]) for i in range(len(names) + 1))
    return (
        bool(names) and fnmatch.fnmatchcase(names[0], pats[0]) and _match_parts(names[1:], pats[1:])
    )


def _one_path_per_file(paths: set[str]) -> list[str]:
    """Sorted paths, one per real file (device and inode): two links to one file, or a file
    and a link to it, would read its rows twice. The path without a link wins, else the
    first in sorted order."""
    chosen: dict[tuple[int, int], str] = {}
    for f in sorted(paths):
        st = os.stat(f)
        key = (st.st_dev, st.st_ino)
        if key not in chosen or (_via_link(chosen[key]) and not _via_link(f)):
            chosen[key] = f
    return sorted(chosen.values())


def _via_link(f: str) -> bool:
    return os.path.realpath(f) != os.path.abspath(f)


def _resolve_uri(path: str) -> list[str]:
    """resolve_files for an object-store URI: the object, the .parquet objects below a
    prefix, or those matching a URI glob (hidden names below the root left out)."""
    try:
        found = list_files(path)
    except OSError as e:
        raise InputDataError(f"input.path: cannot list {path!r}: {e}") from None
    root = ObjectPath(path).uri
    files = []
    for f in found:
        rel = f[len(root) + 1 :] if f.startswith(root + "/") else f.rsplit("/", 1)[-1]
        hidden = any(part.startswith(("_", ".")) for part in rel.split("/"))
        if f == root or (f.endswith(".parquet") and not hidden):
            files.append(f)
    if not files:
        raise InputDataError(f"input.path: {path!r} matches no Parquet file")
    return files


def _hidden(f: str, root: str) -> bool:
    # Spark/Hive markers (_SUCCESS, _metadata, .crc) below the given root are not data
    rel = os.path.relpath(f, root) if os.path.isdir(root) else os.path.basename(f)
    return any(part.startswith(("_", ".")) for part in Path(rel).parts)


def _check_values(rb: pa.RecordBatch, path: str, start: int, file_row: int) -> None:
    """Every value of the batch is what its type says (a corrupt page can decode to text that
    is not UTF-8, which Parquet readers do not check): else InputDataError naming the first
    such row and column."""
    try:
        rb.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    for name, col in zip(rb.schema.names, rb.columns, strict=True):
        if _valid(col):
            continue
        lo, hi = 0, len(col)  # the first bad row: the shortest bad prefix
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if not _valid(col.slice(0, mid)) else (mid, hi)
        i = lo if not _valid(col.slice(lo, 1)) else hi - 1
        raise InputDataError(
            f"row {start + i} (file {os.path.basename(path)}, row {file_row + i}): column "
            f"{name!r} holds bytes that are not valid {col.type} (a corrupt file?)"
        )


def _valid(col: pa.Array) -> bool:
    try:
        col.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _file_batches(src: str, fs, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """One file's record batches, row group after row group. Not pyarrow.dataset's scanner:
    its read-ahead (16 batches, 4 files) held ~430 MB of Arrow buffers on a 1M-row token-id
    file, where this reader holds one row group (~150 MB). One ``iter_batches`` per row group:
    over a whole file its pre-buffered column chunks stay cached to the end (a 1 GB file: ~700
    MB of Arrow buffers by its 100th batch)."""
    with pq.ParquetFile(src, filesystem=fs) as f:
        for rg in range(f.num_row_groups):
            yield from f.iter_batches(batch_size=batch_rows, row_groups=[rg])


@dataclass(frozen=True)
class InputDataset:
    """A validated Parquet dataset: files in row-id order and how to read its columns."""

    files: tuple[str, ...]
    file_rows: tuple[int, ...]  # rows per file (from Parquet metadata)
    prompt_column: str
    prompt_is_text: bool  # True: string column to tokenize; False: list<int> token ids
    max_tokens_column: str | None  # None when the dataset has no such column
    batch_rows: int
    limit: int | None
    builder: PromptBuilder | None = None  # template / messages / chat (None: prompt column)
    # every file's columns unified: a batch of a file lacking a column gets it as nulls, so
    # each batch has the columns the whole dataset read at once would (None: as read)
    schema: pa.Schema | None = None

    @property
    def num_rows(self) -> int:
        n = sum(self.file_rows)
        return n if self.limit is None else min(n, self.limit)

    def batches(self) -> Iterator[PromptBatch]:
        """Stream the dataset as PromptBatches of at most ``batch_rows`` rows."""
        left = self.num_rows
        base = 0
        for path, nrows in zip(self.files, self.file_rows, strict=True):
            if left <= 0:
                return
            file_row = 0
            try:
                src, fs = arrow_source(path)  # a local path, or an object and its filesystem
                for rb in _file_batches(src, fs, self.batch_rows):
                    if left <= 0:
                        break
                    if rb.num_rows == 0:
                        continue
                    if rb.num_rows > left:
                        rb = rb.slice(0, left)
                    _check_values(rb, path, base + file_row, file_row)
                    yield self._to_prompt_batch(rb, path, base + file_row, file_row)
                    file_row += rb.num_rows
                    left -= rb.num_rows
            except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
                raise InputDataError(
                    f"{path}: cannot read Parquet data near row {file_row}: {one_line(e)}"
                ) from None
            base += nrows

    def _to_prompt_batch(self, rb: pa.RecordBatch, path: str, start: int, file_row: int):
        n = rb.num_rows
        row_ids = np.arange(start, start + n, dtype=np.int64)
        table = pa.Table.from_batches([rb])
        rejected = None
        if self.builder is not None:  # batchjob.inputs.prompt_builder: template, messages, chat
            built = self.builder.build(table)
            prompts, drop = built.prompts, list(self.builder.consumed)
            where = [
                f"row {start + i} (file {os.path.basename(path)}, row {file_row + i})"
                for i in built.reject
            ]
            msgs = tuple(f"{w}: {m}" for w, m in zip(where, built.message, strict=True))
            rejected = RejectedRows(row_ids[built.reject], built.status, msgs)
        else:
            prompts, drop = table.column(self.prompt_column).combine_chunks(), [self.prompt_column]
        if pa.types.is_dictionary(prompts.type):
            prompts = prompts.dictionary_decode()
        max_tokens = max_tokens_null = None
        if self.max_tokens_column is not None:
            col = table.column(self.max_tokens_column).combine_chunks()
            max_tokens_null = col.is_null().to_numpy(zero_copy_only=False)
            max_tokens = (
                col.cast(pa.int64(), safe=False).fill_null(0).to_numpy(zero_copy_only=False)
            )
        rest = table.drop_columns([c for c in drop if c in table.column_names])
        for f in self.schema or ():
            if f.name not in table.column_names and f.name not in drop:
                rest = rest.append_column(f.with_nullable(True), pa.nulls(n, f.type))
        if ROW_ID in rest.column_names:  # keep an input column named row_id under another name
            rest = rest.rename_columns(
                ["input_" + c if c == ROW_ID else c for c in rest.column_names]
            )
        passthrough = rest.add_column(0, ROW_ID, pa.array(row_ids, pa.int64()))
        special = self.builder.add_special_tokens if self.builder is not None else True
        return PromptBatch(
            row_ids,
            prompts,
            max_tokens,
            max_tokens_null,
            passthrough,
            path,
            file_row,
            special,
            rejected,
        )


_DEFAULT_MAX_TOKENS_COLUMN = InputConfig.__dataclass_fields__["max_tokens_column"].default


class HasBatches(Protocol):
    def batches(self) -> Iterator[PromptBatch]: ...


def timed_batches(dataset: HasBatches) -> Iterator[tuple[PromptBatch, float]]:
    """``dataset.batches()``, each batch with the seconds reading it took (the read stage's
    time: what the caller does with a batch is not counted)."""
    batches = dataset.batches()
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            return
        yield batch, time.perf_counter() - t0


def _unify(acc: pa.Schema | None, schema: pa.Schema, f: str, first: str) -> pa.Schema:
    """The schema every file so far can be read as; files typing a column differently
    (int in one, string in another) cannot be one dataset."""
    if acc is None:
        return schema
    try:
        return pa.unify_schemas([acc, schema], promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        for field in schema:
            if field.name in acc.names:
                try:
                    pa.unify_schemas(
                        [pa.schema([acc.field(field.name)]), pa.schema([field])],
                        promote_options="permissive",
                    )
                except (pa.ArrowTypeError, pa.ArrowInvalid):
                    raise InputDataError(
                        f"{f}: column {field.name!r} has type {field.type}, but "
                        f"{acc.field(field.name).type} in earlier files (e.g. {first}); "
                        "every input file must type a column the same way"
                    ) from None
        raise InputDataError(f"{f}: schema does not match earlier files (e.g. {first})") from None


def requires_max_tokens_column(cfg: InputConfig) -> bool:
    """input.max_tokens_column names a column that must exist (the default may be absent)."""
    return cfg.max_tokens_column not in (None, _DEFAULT_MAX_TOKENS_COLUMN)


def check_schema(
    cfg: InputConfig, builder: PromptBuilder | None, schema: pa.Schema, where: str
) -> tuple[bool, bool]:
    """One file's (or in-memory table's) columns against ``[input]`` -> (the prompts are text,
    the max_tokens column is present); InputDataError naming ``where`` and the column."""
    names = schema.names
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise InputDataError(
            f"{where}: more than one column named {', '.join(map(repr, dup))}; every column "
            "needs its own name"
        )
    if builder is not None:  # template, messages or a chat prompt: text
        builder.check_schema(schema, where)
    elif cfg.prompt_column not in names:
        raise InputDataError(
            f"{where}: column {cfg.prompt_column!r} (input.prompt_column) not found; "
            f"available columns: {', '.join(names)}"
        )
    ptype = schema.field(cfg.prompt_column).type if builder is None else pa.string()
    if not (_is_text(ptype) or _is_token_list(ptype)):
        raise InputDataError(
            f"{where}: column {cfg.prompt_column!r} has type {ptype}; expected string "
            "(text to tokenize) or list<int> (token ids)"
        )
    if cfg.id_column is not None and cfg.id_column not in names:
        raise InputDataError(
            f"{where}: column {cfg.id_column!r} (input.id_column) not found; "
            f"available columns: {', '.join(names)}"
        )
    mt = cfg.max_tokens_column
    has_mt = mt is not None and mt in names
    if mt is not None and has_mt and not pa.types.is_integer(schema.field(mt).type):
        raise InputDataError(
            f"{where}: column {mt!r} (input.max_tokens_column) has type "
            f"{schema.field(mt).type}; expected an integer type"
        )
    return _is_text(ptype), has_mt


def check_ids(files: list[str], column: str, limit: int | None) -> None:
    """``input.id_column`` holds one distinct, non-null id per row (the first ``limit`` rows):
    resume and exactly-once are keyed by the row, so a repeated or missing id is refused
    (InputDataError, exit 4) naming the first such row, before any work. Reads that column
    alone."""
    import bisect

    import polars as pl

    parts: list[pa.Array] = []
    starts: list[int] = []
    for f in files:
        src, fs = arrow_source(f)
        try:
            col = pq.read_table(src, columns=[column], filesystem=fs).column(0)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise InputDataError(f"{f}: cannot read column {column!r}: {one_line(e)}") from None
        starts.append(sum(map(len, parts)))
        parts.append(col.combine_chunks())
    ids = pl.Series(pa.chunked_array(parts))
    if limit is not None:
        ids = ids.head(limit)
    null = int(ids.is_null().arg_max() or 0) if ids.null_count() else None
    repeated = ~ids.is_first_distinct() & ids.is_not_null()
    again = int(repeated.arg_max() or 0) if repeated.any() else None
    if null is None and again is None:
        return
    i = min(j for j in (null, again) if j is not None)
    k = bisect.bisect_right(starts, i) - 1
    at = f"row {i} (file {os.path.basename(files[k])}, row {i - starts[k]})"
    if i == null:
        why = f"input.id_column {column!r} is null"
    else:
        first = int((ids == ids[i]).arg_max() or 0)
        why = f"input.id_column {column!r} repeats the id {ids[i]!r} of row {first}"
    raise InputDataError(
        f"{at}: {why}; every row needs its own id (resume and exactly-once are keyed by it)"
    )


def open_dataset(cfg: InputConfig, model: ModelConfig | None = None) -> InputDataset:
    """Resolve and validate Parquet input (schema of every file); reads no row data. The job
    opens its input through batchjob.inputs.source.open_input, which also takes OpenAI JSONL.

    ``model``: the job's model section, to load a chat template (None: metadata only)."""
    builder = make_builder(cfg, model)
    files = resolve_files(cfg.path)
    rows: list[int] = []
    kinds: set[bool] = set()
    has_max_tokens: set[bool] = set()
    schemas: list[pa.Schema] = []
    for f in files:
        try:
            src, fs = arrow_source(f)
            meta = pq.read_metadata(src, filesystem=fs)
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise InputDataError(f"{f}: not a readable Parquet file ({one_line(e)})") from None
        rows.append(meta.num_rows)
        schemas.append(schema)
        is_text, has_mt = check_schema(cfg, builder, schema, f)
        kinds.add(is_text)
        has_max_tokens.add(has_mt)
    if len(kinds) > 1:
        raise InputDataError(
            f"column {cfg.prompt_column!r} is text in some files and token ids in others"
        )
    if len(has_max_tokens) > 1:
        raise InputDataError(
            f"column {cfg.max_tokens_column!r} exists in some input files but not in others"
        )
    unified = None
    for f, schema in zip(files, schemas, strict=True):
        unified = _unify(unified, schema, f, files[0])
    if requires_max_tokens_column(cfg) and True not in has_max_tokens:
        raise InputDataError(
            f"{files[0]}: column {cfg.max_tokens_column!r} (input.max_tokens_column) not found; "
            f"available columns: {', '.join(schemas[0].names)}"
        )
    if sum(rows) == 0:
        raise InputDataError(f"input.path: {cfg.path!r} has 0 rows ({len(files)} file(s))")
    if cfg.id_column is not None:
        check_ids(files, cfg.id_column, cfg.limit)
    return InputDataset(
        files=tuple(files),
        file_rows=tuple(rows),
        prompt_column=cfg.prompt_column,
        prompt_is_text=kinds.pop(),
        max_tokens_column=cfg.max_tokens_column if has_max_tokens.pop() else None,
        batch_rows=cfg.batch_rows,
        limit=cfg.limit,
        builder=builder,
        schema=unified if len(files) > 1 else None,
    )
