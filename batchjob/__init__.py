"""batchjob: offline batch LLM inference for prefix-shared Parquet datasets."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchjob.config import JobConfig
    from batchjob.runner.pipeline import JobResult

from batchjob.version import __version__ as __version__


def run(job: JobConfig | str | Path, progress: bool = False) -> JobResult:
    """Run a job (a ``JobConfig`` or a path to its TOML file); see ``batchjob.runner.pipeline``."""
    from batchjob.config import JobConfig, load_job
    from batchjob.runner.pipeline import run as run_job

    return run_job(job if isinstance(job, JobConfig) else load_job(job), progress=progress)
