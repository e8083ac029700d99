"""Where a job's files go and what they are called.

A run owns exactly two paths: its results path and its metadata folder, the results path with
``.meta`` appended (``OutputLayout.meta``)::

    out/res.parquet   -> out/res.parquet.meta/     (output.path ending in .parquet: one file)
    out/day1          -> out/day1.meta/            (any other path: a results folder)

The metadata folder holds::

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
file of another under the same name. What in a results folder is batchjob's, and which paths
an output may not take: ``ownership``; what a killed run leaves and how it is put right:
``recovery``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from batchjob.config import OutputConfig
from batchjob.errors import ConfigError
from batchjob.storage.stores import ObjectPath, store_for

SUCCESS = "_SUCCESS"
RESULT_GLOB = "results-*.parquet"
META_SUFFIX = ".meta"
COMMITTER = "batchjob"  # the "committer" of a _SUCCESS batchjob wrote
# temp files of batchjob's atomic writes into a results folder (storage.atomic names)
OUR_TEMP = re.compile(r"\.(results-[^/]*\.parquet|_SUCCESS)\.[^/]*\.tmp")


def result_name(index: int, commit: str) -> str:
    return f"results-{index:05d}-{commit}.parquet"


def meta_of(path: Any) -> Any:
    """The metadata folder of the output ``path`` (a Path or an ObjectPath)."""
    return path.with_name(path.name + META_SUFFIX)


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
        """On an object store: no rename, no fcntl."""
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
    def twin(self) -> Any:
        """The other kind of output with the same OpenAI Batch file: out/res <-> out/res.parquet."""
        if self.single_file:
            return self.output.with_name(self.output.stem)
        return self.output.with_name(self.output.name + ".parquet")

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
