"""Where a job's files go, and the checks on the output path made before any work.

Results: ``output.path`` ending in ``.parquet`` is one file; any other path is a folder of
``results-NNNNN.parquet`` files and ``_SUCCESS``, nothing else (a plain dataset for pyarrow,
polars, Spark, DuckDB). Everything else lives in the sibling metadata folder
(``OutputLayout.meta``: ``out/results.parquet`` -> ``out/results.meta/``, ``out/day1``
-> ``out/day1.meta/``)::

    lock             held (fcntl) by the run writing this output
    manifest.json    the fingerprint of the job whose results are committed
    parts/           finished rows of the unfinished run, + parts/manifest.json (its job)
    staging/         the final files being written, moved into place at commit
    plan.parquet, report.json, report.*.parquet, report.timeline.png

On an object store (``output.path = "s3://bucket/prefix"``, storage.stores) the layout is the
same, less what needs a rename: no ``staging/`` (results are written in place at commit and the
folder is complete only once ``_SUCCESS`` is written, last), no temp files (one PUT is atomic),
and ``lock`` is an object created with a conditional put (batchjob.storage.lock).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from batchjob.config import OutputConfig
from batchjob.errors import ConfigError
from batchjob.storage.stores import ObjectPath, is_uri, store_for

SUCCESS = "_SUCCESS"
RESULT_GLOB = "results-*.parquet"


@dataclass(frozen=True)
class OutputLayout:
    output: Path | ObjectPath  # the results file or folder
    single_file: bool  # output.path ends in .parquet: one file, else a folder
    meta: Path | ObjectPath  # sibling metadata folder
    report_file: Path | ObjectPath  # output.report_path, default <meta>/report.json
    plan_file: Path | ObjectPath  # output.plan_path, default <meta>/plan.parquet
    jsonl_file: Path | ObjectPath  # OpenAI Batch output lines: out/results.jsonl, out/day1.jsonl

    @classmethod
    def of(cls, cfg: OutputConfig) -> OutputLayout:
        """``out/results.parquet`` -> meta ``out/results.meta/``; the results folder
        ``out/day1`` -> ``out/day1.meta/`` (so the results folder is a plain dataset)."""
        single = cfg.path.suffix == ".parquet"
        stem = cfg.path.stem if single else cfg.path.name
        meta = cfg.path.with_name(stem + ".meta")
        return cls(
            output=cfg.path,
            single_file=single,
            meta=meta,
            report_file=cfg.report_path or meta / "report.json",
            plan_file=cfg.plan_path or meta / "plan.parquet",
            jsonl_file=cfg.path.with_name(stem + ".jsonl"),
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
        return self.meta / "staging"

    @property
    def trash(self) -> Any:
        """Parts being removed after a commit (renamed first, so cleanup is all or nothing)."""
        return self.meta / ".parts.trash"

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

    def check(self, input_path: str, input_files: tuple[str, ...] | list[str]) -> None:
        """Refuse an output that is, holds or sits inside the input, or the wrong kind of
        path; ``ConfigError`` (exit 3) naming output.path."""
        if isinstance(self.output, ObjectPath):
            self._check_remote(input_path, input_files)
            return
        assert isinstance(self.meta, Path)
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
        """Remove what a killed run can leave: staging, half-removed parts, temp files.
        Call with the lock held. Parts and their manifest are kept (they resume). An object
        store has no staging and no temp objects; its half-removed parts carry a marker."""
        if not isinstance(self.meta, Path) or not isinstance(self.output, Path):
            if self.store.exists(self.cleanup_marker):  # a kill during results.cleanup
                self.store.delete_tree(self.parts)
            return
        shutil.rmtree(self.staging, ignore_errors=True)
        shutil.rmtree(self.trash, ignore_errors=True)
        for folder in (self.meta, self.parts, self.output.parent):
            if folder.is_dir():
                for tmp in folder.glob(".*.tmp"):
                    if folder != self.output.parent or tmp.name.startswith(f".{self.output.name}."):
                        tmp.unlink(missing_ok=True)
        if not self.single_file and self.output.is_dir():
            for tmp in self.output.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
