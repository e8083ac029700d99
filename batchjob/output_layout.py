"""Where a job's files go, and the checks on the output path made before any work.

Results: ``output.path`` ending in ``.parquet`` is one file; any other path is a folder of
``results-NNNNN.parquet`` files and ``_SUCCESS``, nothing else (a plain dataset for pyarrow,
polars, Spark, DuckDB). Everything else lives in the sibling metadata folder
(``OutputConfig.meta_dir``: ``out/results.parquet`` -> ``out/results.meta/``, ``out/day1``
-> ``out/day1.meta/``)::

    lock             held (fcntl) by the run writing this output
    manifest.json    the fingerprint of the job whose results are committed
    parts/           finished rows of the unfinished run, + parts/manifest.json (its job)
    staging/         the final files being written, moved into place at commit
    plan.parquet, report.json, report.*.parquet, report.timeline.png
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from batchjob.config import OutputConfig
from batchjob.errors import ConfigError

SUCCESS = "_SUCCESS"
RESULT_GLOB = "results-*.parquet"


@dataclass(frozen=True)
class OutputLayout:
    output: Path  # the results file or folder
    single_file: bool
    meta: Path  # sibling metadata folder

    @classmethod
    def of(cls, cfg: OutputConfig) -> OutputLayout:
        return cls(cfg.path, cfg.is_file, cfg.meta_dir)

    @property
    def lock_file(self) -> Path:
        return self.meta / "lock"

    @property
    def manifest_file(self) -> Path:
        """Manifest of the committed results (absent while none are committed)."""
        return self.meta / "manifest.json"

    @property
    def parts(self) -> Path:
        return self.meta / "parts"

    @property
    def parts_manifest(self) -> Path:
        return self.parts / "manifest.json"

    @property
    def staging(self) -> Path:
        return self.meta / "staging"

    @property
    def trash(self) -> Path:
        """Parts being removed after a commit (renamed first, so cleanup is all or nothing)."""
        return self.meta / ".parts.trash"

    @property
    def done_marker(self) -> Path:
        return self.output if self.single_file else self.output / SUCCESS

    def complete(self) -> bool:
        return self.done_marker.is_file()

    def has_parts(self) -> bool:
        return self.parts.is_dir() and any(self.parts.glob("part-*.parquet"))

    def check(self, input_path: str, input_files: tuple[str, ...] | list[str]) -> None:
        """Refuse an output that is, holds or sits inside the input, or the wrong kind of
        path; ``ConfigError`` (exit 3) naming output.path."""
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

    def prepare(self) -> None:
        """Create the metadata folder; an unwritable place is a ConfigError, not a traceback."""
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
        Call with the lock held. Parts and their manifest are kept (they resume)."""
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
