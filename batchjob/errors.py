"""Error types and the exit codes the CLI maps them to.

An Airflow task or a cron wrapper tells a bad job file or bad input data (do not retry:
fix the data) apart from a runtime failure (may retry) by the exit code alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

EXIT_OK = 0
EXIT_RUNTIME = 1  # unexpected failure while running: retrying may help
EXIT_USAGE = 2  # bad command line (click's own code)
EXIT_CONFIG = 3  # the job file or a flag is invalid
EXIT_INPUT = 4  # the input dataset is invalid (missing/mistyped column, corrupt file, empty)
EXIT_MODEL = 5  # the model folder is missing, incomplete or unsupported
EXIT_ALL_REJECTED = 6  # every input row was rejected (see the per-row reasons): fix the data
EXIT_LOCKED = 75  # another run holds this output (sysexits EX_TEMPFAIL): wait, do not race it
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM: written results are intact, rerun resumes


def one_line(e: object) -> str:
    """An error's text on one line: a library's multi-line message (pyarrow's thrift errors)
    joined with "; ", control characters escaped."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = "; ".join(lines) or type(e).__name__
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class BatchJobError(Exception):
    """Base class: a user-facing error with a clear message and an exit code.

    A subclass names its code in its header: ``class ConfigError(BatchJobError, exit_code=3)``.
    """

    exit_code: ClassVar[int] = EXIT_RUNTIME

    def __init_subclass__(cls, exit_code: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if exit_code is not None:
            cls.exit_code = exit_code


class ConfigError(BatchJobError, exit_code=EXIT_CONFIG):
    """The job file or a CLI override is invalid; the message names the key and the file."""


class InputDataError(BatchJobError, exit_code=EXIT_INPUT):
    """The input dataset is unusable; the message names the file, row and column."""


class ModelError(BatchJobError, exit_code=EXIT_MODEL):
    """The model folder is missing, incomplete, or of an unsupported architecture."""


class AllRowsRejectedError(BatchJobError, exit_code=EXIT_ALL_REJECTED):
    """No input row can run (every row has a per-row error); nothing is written."""


class LockedError(BatchJobError, exit_code=EXIT_LOCKED):
    """Another run is writing the same output; this one started no work."""
