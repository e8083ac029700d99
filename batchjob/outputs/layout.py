"""Where a job's files go, what the run owns there, and the checks made before any work.

A run owns exactly two paths: its results path and its metadata folder, the results path with
``.meta`` appended (``OutputLayout.meta``)::

    out/res.parquet   -> out/res.parquet.meta/     (output.path ending in .parquet: one file)
    out/day1          -> out/day1.meta/            (any other path: a results folder)

No two output paths share a metadata folder, and no output path is another's metadata folder:
a path whose name ends in ``.meta`` is refused, as is a path inside another output's results or
metadata folder. The metadata folder holds::

    lock             held (fcntl) by the run writing this output; its pid and run token
    manifest.json    the fingerprint of the job whose results are committed, + their file list
    parts/           finished rows of the unfinished run, + parts/manifest.json (its job)
    staging/         the new results being written; at commit it becomes the results folder
    previous/        only between the two renames of a commit without rename-exchange
    commit.json      only during an in-place commit: the files it writes and replaces
    plan.parquet, report.json, report.*.parquet, report.timeline.png

A results folder holds ``results-NNNNN-<commit>.parquet`` files and ``_SUCCESS`` (JSON: the
commit id, row count and file names), nothing else: a plain dataset for pyarrow, polars, Spark,
DuckDB. File names are new at every commit, so a reader that listed one commit never opens a
file of another under the same name. An existing folder holding anything batchjob did not
write (``foreign_entries``) is refused unless ``output.allow_other_files``; batchjob never
deletes such files.

Commit modes of a folder (``results.ResultSink``): ``swap`` (local, the folder batchjob's own:
the staged folder is exchanged with the old one in one ``renameat2(RENAME_EXCHANGE)``, or two
renames with a recovery rule in ``clean_stale``) and ``in place`` (object stores, and a local
folder shared with other files: ``_SUCCESS`` removed, new files written, old ones deleted,
``_SUCCESS`` written last; see docs/operations.md for what readers see).

Metadata folders of earlier versions: a single-file output ``out/res.parquet`` had its metadata
in ``out/res.meta/``. When that folder's manifest names this output, ``adopt_legacy_meta`` moves
it to ``out/res.parquet.meta/`` (under its lock), so an interrupted job resumes and a complete
one stays complete; on an object store it is refused with what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import os
import re
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from batchjob.config import OutputConfig
from batchjob.errors import ConfigError, LockedError
from batchjob.outputs.manifest import legacy_fingerprint
from batchjob.storage.stores import ObjectPath, is_uri, store_for

SUCCESS = "_SUCCESS"
RESULT_GLOB = "results-*.parquet"
META_SUFFIX = ".meta"
COMMITTER = "batchjob"  # the "committer" of a _SUCCESS batchjob wrote
_LEGACY_RESULT = re.compile(r"results-\d{5}\.parquet")  # earlier versions' names
_LEGACY_SUCCESS = re.compile(r"\d+ rows\n?")
# temp files of batchjob's atomic writes into a results folder (storage.atomic names)
_OUR_TEMP = re.compile(r"\.(results-[^/]*\.parquet|_SUCCESS)\.[^/]*\.tmp")


def result_name(index: int, commit: str) -> str:
    return f"results-{index:05d}-{commit}.parquet"


def meta_of(path: Any) -> Any:
    """The metadata folder of the output ``path`` (a Path or an ObjectPath)."""
    return path.with_name(path.name + META_SUFFIX)


def _read_text(store: Any, path: Any) -> str:
    """The file's text, or "" when it cannot be read (absent, a folder, not text)."""
    try:
        return str(store.read_text(path))
    except (OSError, ValueError, UnicodeDecodeError):
        return ""


def _read_json(store: Any, path: Any) -> dict[str, Any] | None:
    try:
        v = json.loads(_read_text(store, path) or "null")
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def is_legacy_manifest(m: dict[str, Any] | None) -> bool:
    """Written by a version that identified input files by size and mtime (no content)."""
    fp = (m or {}).get("fingerprint")
    return isinstance(fp, dict) and legacy_fingerprint(fp)


def _manifest_output(m: dict[str, Any] | None) -> str | None:
    """The output.path a manifest was written for (every batchjob manifest records it)."""
    try:
        v = m["job"]["config"]["output"]["path"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return v if isinstance(v, str) else None


def _same_local(a: str | Path, b: str | Path) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


@dataclass(frozen=True)
class OutputLayout:
    output: Path | ObjectPath  # the results file or folder
    single_file: bool  # output.path ends in .parquet: one file, else a folder
    meta: Path | ObjectPath  # the metadata folder: the output path + ".meta"
    report_file: Path | ObjectPath  # output.report_path, default <meta>/report.json
    plan_file: Path | ObjectPath  # output.plan_path, default <meta>/plan.parquet
    jsonl_file: Path | ObjectPath  # OpenAI Batch output lines: out/results.jsonl, out/day1.jsonl
    others_allowed: bool = False  # output.allow_other_files
    writes_jsonl: bool = False  # output.format = "openai-jsonl"

    @classmethod
    def of(cls, cfg: OutputConfig) -> OutputLayout:
        """``out/results.parquet`` -> meta ``out/results.parquet.meta/``; the results folder
        ``out/day1`` -> ``out/day1.meta/`` (so the results folder is a plain dataset)."""
        single = cfg.path.suffix == ".parquet"
        stem = cfg.path.stem if single else cfg.path.name
        meta = meta_of(cfg.path)
        return cls(
            output=cfg.path,
            single_file=single,
            meta=meta,
            report_file=cfg.report_path or meta / "report.json",
            plan_file=cfg.plan_path or meta / "plan.parquet",
            jsonl_file=cfg.path.with_name(stem + ".jsonl"),
            others_allowed=cfg.allow_other_files,
            writes_jsonl=cfg.format == "openai-jsonl",
        )

    @property
    def remote(self) -> bool:
        """On an object store: no rename, no fcntl (see the module doc)."""
        return isinstance(self.output, ObjectPath)

    @cached_property
    def store(self) -> Any:
        """batchjob.storage.stores.LocalStore or ObjectStore for this output's paths."""
        return store_for(self.output)

    @property
    def lock_file(self) -> Any:
        return self.meta / "lock"

    @property
    def manifest_file(self) -> Any:
        """Manifest of the committed results (absent while none are committed)."""
        return self.meta / "manifest.json"

    @property
    def parts(self) -> Any:
        return self.meta / "parts"

    @property
    def parts_manifest(self) -> Any:
        return self.parts / "manifest.json"

    @property
    def cleanup_marker(self) -> Any:
        """Object-store parts being deleted after their commit (see results.cleanup)."""
        return self.parts / "_CLEANUP"

    @property
    def staging(self) -> Any:
        """The new results: a folder that becomes the results folder, or the one file."""
        return self.meta / "staging"

    @property
    def previous(self) -> Any:
        """The old results folder between the two renames of a commit (no rename-exchange)."""
        return self.meta / "previous"

    @property
    def commit_log(self) -> Any:
        """An in-place commit's files written and replaced (while it runs)."""
        return self.meta / "commit.json"

    @property
    def trash(self) -> Any:
        """Parts being removed after a commit (renamed first, so cleanup is all or nothing)."""
        return self.meta / ".parts.trash"

    @property
    def legacy_meta(self) -> Any:
        """Where earlier versions kept a single-file output's metadata (out/res.meta/)."""
        return self.output.with_name(self.output.stem + META_SUFFIX)

    @property
    def done_marker(self) -> Any:
        return self.output if self.single_file else self.output / SUCCESS

    def complete(self) -> bool:
        return bool(self.store.is_file(self.done_marker))

    def has_parts(self) -> bool:
        return bool(self.part_files())

    def part_files(self) -> list[Any]:
        """The parts written so far (sorted by name)."""
        if not self.remote and not self.parts.is_dir():
            return []
        return list(self.store.glob(self.parts, "part-*.parquet"))

    def drop_parts(self) -> None:
        """Remove another job's parts (all or nothing locally: renamed away first)."""
        if self.remote:
            self.store.delete_tree(self.parts)
            return
        if self.parts.exists():
            shutil.rmtree(self.trash, ignore_errors=True)
            self.parts.rename(self.trash)
            shutil.rmtree(self.trash)

    # ------------------------------------------------------------------------------------
    # what in the results folder is batchjob's

    def read_success(self) -> dict[str, Any] | None:
        """The results folder's ``_SUCCESS`` when batchjob wrote it (its commit, rows, files)."""
        if self.single_file:
            return None
        s = _read_json(self.store, self.output / SUCCESS)
        return s if s is not None and s.get("committer") == COMMITTER else None

    def _vouched_legacy(self) -> bool:
        """This output's metadata holds a manifest of an earlier version: the results folder's
        ``results-NNNNN.parquet`` and ``_SUCCESS`` were written by batchjob."""
        for f in (self.manifest_file, self.parts_manifest):
            m = _read_json(self.store, f)
            if m is not None and "results" not in m and is_legacy_manifest(m):
                return True
        return False

    def owned_results(self) -> set[str]:
        """Names in the results folder that batchjob wrote for this output: the files listed by
        its ``_SUCCESS``, the committed manifest and an unfinished in-place commit, those
        files' temp files, ``_SUCCESS`` itself; earlier versions' names where vouched for."""
        if self.single_file:
            return set()
        present = set(self.store.names(self.output))
        owned: set[str] = set()
        if (s := self.read_success()) is not None:
            owned |= set(s.get("files") or []) | {SUCCESS}
        m = _read_json(self.store, self.manifest_file) or {}
        owned |= set((m.get("results") or {}).get("files") or [])
        log = _read_json(self.store, self.commit_log) or {}
        owned |= set(log.get("files") or []) | set(log.get("replaces") or [])
        owned |= {n for n in present if _OUR_TEMP.fullmatch(n)}
        if self._vouched_legacy():
            owned |= {n for n in present if _LEGACY_RESULT.fullmatch(n)}
            if SUCCESS in present and _LEGACY_SUCCESS.fullmatch(
                _read_text(self.store, self.output / SUCCESS)
            ):
                owned.add(SUCCESS)
        return owned & present

    def foreign_entries(self) -> list[str]:
        """What the results folder holds that batchjob did not write (never deleted)."""
        if self.single_file:
            return []
        owned = self.owned_results()
        return [n for n in self.store.names(self.output) if n not in owned]

    def swappable(self) -> bool:
        """A local results folder that is batchjob's alone and can be swapped by rename: not
        a link or a mount point, on the metadata folder's filesystem, no foreign entries."""
        if self.remote or self.single_file:
            return False
        assert isinstance(self.output, Path) and isinstance(self.meta, Path)
        if self.output.is_symlink():
            return False
        if not self.output.exists():
            return True
        if os.path.ismount(self.output) or self.foreign_entries():
            return False
        return self.output.stat().st_dev == self.meta.stat().st_dev

    # ------------------------------------------------------------------------------------
    # checks before any work

    def check(self, input_path: str, input_files: tuple[str, ...] | list[str]) -> None:
        """Refuse an output that is, holds or sits inside the input, the wrong kind of path,
        a metadata folder, a path inside another output, or a results folder holding files
        batchjob did not write (unless ``allow_other_files``); ``ConfigError`` (exit 3)."""
        if not self.output.name or self.output.name in (".", ".."):
            raise ConfigError(f"output.path: {str(self.output)!r} names no file or folder")
        if self.output.name.endswith(META_SUFFIX):
            raise ConfigError(
                f"output.path: {self.output} ends in {META_SUFFIX}, the name batchjob gives "
                "metadata folders (another output's metadata may live there): choose "
                "another output.path"
            )
        if isinstance(self.output, ObjectPath):
            self._check_remote(input_path, input_files)
        else:
            self._check_local(input_path, input_files)
        self.check_jsonl_twin()

    def _check_local(self, input_path: str, input_files: tuple[str, ...] | list[str]) -> None:
        assert isinstance(self.meta, Path) and isinstance(self.output, Path)
        out = self.output.resolve()
        meta = self.meta.resolve()
        for f in input_files:
            fp = Path(f).resolve()
            if fp in (out, meta) or out in fp.parents or meta in fp.parents:
                raise ConfigError(
                    f"output.path: {self.output} is or holds the input file {f} "
                    "(input.path); results would replace the input: choose another output.path"
                )
        inp = Path(input_path)
        if not inp.exists() and fnmatch.fnmatch(str(out), input_path):
            raise ConfigError(
                f"output.path: {self.output} matches the input pattern {input_path} "
                "(input.path); the next run would read the results as input: choose another "
                "output.path"
            )
        if inp.is_dir() and (inp.resolve() in out.parents or inp.resolve() in meta.parents):
            raise ConfigError(
                f"output.path: {self.output} is inside the input folder {input_path} "
                "(input.path); the next run would read the results as input: choose another "
                "output.path"
            )
        for anc in out.parents:
            if not anc.name:
                continue
            if anc.name.endswith(META_SUFFIX) and (anc / "lock").exists():
                raise ConfigError(
                    f"output.path: {self.output} is inside {anc}, the metadata folder of "
                    "another output: choose another output.path"
                )
            if (meta_of(anc) / "lock").exists():
                raise ConfigError(
                    f"output.path: {self.output} is inside {anc}, the results folder of "
                    "another batchjob output: choose another output.path"
                )
        if self.single_file and self.output.is_dir():
            raise ConfigError(
                f"output.path: {self.output} is a folder; a path ending in .parquet names "
                "one results file (drop the suffix for a results folder)"
            )
        if not self.single_file and self.output.exists() and not self.output.is_dir():
            raise ConfigError(
                f"output.path: {self.output} is a file; a path not ending in .parquet names "
                "a results folder"
            )

    def _check_remote(self, input_path: str, input_files: tuple[str, ...] | list[str]) -> None:
        """check() for an object-store output: the same rules on URI strings."""
        assert isinstance(self.output, ObjectPath) and isinstance(self.meta, ObjectPath)
        out, meta = self.output, self.meta
        for f in input_files:
            if is_uri(f) and (
                ObjectPath(f).is_relative_to(out) or ObjectPath(f).is_relative_to(meta)
            ):
                raise ConfigError(
                    f"output.path: {out} is or holds the input file {f} (input.path); results "
                    "would replace the input: choose another output.path"
                )
        if is_uri(input_path):
            inp = ObjectPath(input_path)
            if (
                fnmatch.fnmatchcase(out.uri, inp.uri)
                or out.is_relative_to(inp)
                or meta.is_relative_to(inp)
            ):
                raise ConfigError(
                    f"output.path: {out} is inside or matches the input {input_path} "
                    "(input.path); the next run would read the results as input: choose "
                    "another output.path"
                )
        key = out.key.split("/")
        if any(part.endswith(META_SUFFIX) for part in key[1:-1]):
            raise ConfigError(
                f"output.path: {out} is inside a folder named *{META_SUFFIX}, where batchjob "
                "keeps an output's metadata: choose another output.path"
            )
        store = self.store
        if self.single_file and store.is_dir(out):
            raise ConfigError(
                f"output.path: {out} is a folder; a path ending in .parquet names one results "
                "file (drop the suffix for a results folder)"
            )
        if not self.single_file and store.is_file(out):
            raise ConfigError(
                f"output.path: {out} is an object; a path not ending in .parquet names a "
                "results folder"
            )

    def check_results_folder(self) -> None:
        """Before writing: a results folder that holds anything batchjob did not write is
        refused (exit 3) unless ``output.allow_other_files``; a ``_SUCCESS`` batchjob did not
        write is refused always (the commit would replace it)."""
        foreign = self.foreign_entries()
        if not foreign:
            return
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        if SUCCESS in foreign:
            raise ConfigError(
                f"output.path: {self.output} holds a {SUCCESS} that batchjob did not write "
                "(another tool's results); batchjob would replace it: choose another "
                "output.path"
            )
        if not self.others_allowed:
            raise ConfigError(
                f"output.path: {self.output} is a folder holding files batchjob did not write "
                f"({shown}); batchjob never deletes them, and a results folder holds only "
                "results: choose a new or empty folder, or set output.allow_other_files = true "
                "to write the results beside them"
            )

    def _twin(self) -> Any:
        """The other kind of output with the same OpenAI Batch file: out/res <-> out/res.parquet."""
        if self.single_file:
            return self.output.with_name(self.output.stem)
        return self.output.with_name(self.output.name + ".parquet")

    def check_jsonl_twin(self) -> None:
        """``output.format = "openai-jsonl"`` writes ``out/res.jsonl`` for both ``out/res`` and
        ``out/res.parquet``: refuse when the other one's job writes it already."""
        if not self.writes_jsonl:
            return
        twin = self._twin()
        twin_meta = meta_of(twin)
        for f in (twin_meta / "manifest.json", twin_meta / "parts" / "manifest.json"):
            m = _read_json(self.store, f)
            fmt = (((m or {}).get("job") or {}).get("config") or {}).get("output", {})
            owner = _manifest_output(m)
            if fmt.get("format") == "openai-jsonl" and owner and _same_str(owner, twin):
                raise ConfigError(
                    f"output.path: {self.jsonl_file} is already the OpenAI Batch output of the "
                    f"job writing {twin}: choose another output.path"
                )

    # ------------------------------------------------------------------------------------
    # the metadata folder

    def adopt_legacy_meta(self) -> None:
        """Move an earlier version's metadata of this single-file output (``out/res.meta/``,
        its manifest naming this output) to ``out/res.parquet.meta/``, under that folder's
        lock: its parts resume and its results stay this job's. A folder whose manifest names
        another output (the results folder ``out/res``) is left alone."""
        if not self.single_file:
            return
        legacy = self.legacy_meta
        store = self.store
        if not store.is_dir(legacy):
            return
        found = [
            m
            for f in (legacy / "manifest.json", legacy / "parts" / "manifest.json")
            if (m := _read_json(store, f)) is not None
        ]
        if not any(_same_str(o, self.output) for m in found if (o := _manifest_output(m))):
            return  # not this output's (another output's, or not batchjob's)
        if isinstance(legacy, ObjectPath):
            raise ConfigError(
                f"output.path: {legacy} holds this output's metadata as an earlier batchjob "
                f"version named it; this version keeps it in {self.meta}: move the objects "
                f"below {legacy}/ to {self.meta}/ to resume, or delete them to start over"
            )
        assert isinstance(self.meta, Path)
        for f in (self.manifest_file, self.parts_manifest):
            if f.exists():
                raise ConfigError(
                    f"output.path: both {legacy} (an earlier version's metadata of this output) "
                    f"and {self.meta} hold a job: delete the one to drop"
                )
        fd = os.open(legacy / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockedError(
                    f"output.path: another batchjob run is writing {self.output} (lock "
                    f"{legacy / 'lock'}); this run did nothing"
                ) from None
            if not self.meta.exists():
                os.rename(legacy, self.meta)
                return
            for entry in sorted(os.listdir(legacy)):
                if entry != "lock" and not (self.meta / entry).exists():
                    os.replace(legacy / entry, self.meta / entry)
            (legacy / "lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # unless something is left (a second report)
                legacy.rmdir()
        finally:
            os.close(fd)

    def prepare(self) -> None:
        """Create the metadata folder; an unwritable place is a ConfigError, not a traceback."""
        if isinstance(self.meta, ObjectPath):
            bucket = ObjectPath(f"{self.meta.scheme}://{self.meta.bucket}")
            if self.meta.scheme in ("s3", "s3a") and not self.store.exists(bucket):
                raise ConfigError(
                    f"output.path: bucket {bucket} not found (or not visible with these "
                    "credentials); create it or choose another output.path"
                )
            return
        try:
            self.meta.mkdir(parents=True, exist_ok=True)
            if not os.access(self.meta, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise ConfigError(
                f"output.path: cannot create {self.meta} ({e.strerror or e}); "
                "choose a writable output.path"
            ) from None

    def clean_stale(self) -> None:
        """Put right what a killed run can leave; call with the lock held. A commit killed
        between its two renames (no rename-exchange) left the old results in ``previous/``
        and no results folder: they are moved back (the parts recommit). Staging,
        half-removed parts and batchjob's temp files are removed; parts and their manifest
        are kept (they resume). An object store has no staging and no temp objects; its
        half-removed parts carry a marker."""
        if not isinstance(self.meta, Path) or not isinstance(self.output, Path):
            if self.store.exists(self.cleanup_marker):  # a kill during results.cleanup
                self.store.delete_tree(self.parts)
            return
        if self.previous.is_dir():
            if not self.output.exists() and not self.output.is_symlink():
                os.rename(self.previous, self.output)
            else:
                shutil.rmtree(self.previous)
        shutil.rmtree(self.staging, ignore_errors=True)
        shutil.rmtree(self.trash, ignore_errors=True)
        for folder in (self.meta, self.parts, self.output.parent):
            if folder.is_dir():
                for tmp in folder.glob(".*.tmp"):
                    if folder != self.output.parent or tmp.name.startswith(f".{self.output.name}."):
                        tmp.unlink(missing_ok=True)
        if not self.single_file and self.output.is_dir():
            for name in os.listdir(self.output):
                if _OUR_TEMP.fullmatch(name):
                    (self.output / name).unlink(missing_ok=True)


def committed_files(results: Path | ObjectPath) -> list[Any]:
    """The files of committed results: the results file, or the files a results folder's
    batchjob ``_SUCCESS`` lists (a folder shared with other files holds more); a folder
    without one (an earlier version's): every ``*.parquet`` in it."""
    store = store_for(results)
    if not store.is_dir(results):
        return [results]
    s = _read_json(store, results / SUCCESS)
    if s is not None and s.get("committer") == COMMITTER:
        names = [n for n in s.get("files") or [] if isinstance(n, str)]
        return [results / n for n in names if n not in (".", "..") and "/" not in n]
    return list(store.glob(results, "*.parquet"))


def _same_str(a: str, b: Path | ObjectPath) -> bool:
    """Does the recorded output path ``a`` name ``b``?"""
    if isinstance(b, ObjectPath):
        return is_uri(a) and ObjectPath(a) == b
    return not is_uri(a) and _same_local(a, b)
