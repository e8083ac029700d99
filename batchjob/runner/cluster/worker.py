"""One engine worker of a cluster job: runs shards of the plan into its own part files.

A plain class; the driver makes it a Ray actor (``ray.remote(ShardWorker)``), so this module
imports no Ray. Its part files carry its writer id (``part-000003-w1.parquet``): workers
never write the same name, and a rerun of the job reads every part as done, whoever wrote it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from batchjob.config import JobConfig
from batchjob.outputs.layout import OutputLayout
from batchjob.outputs.results import ResultSink
from batchjob.outputs.score_columns import job_columns
from batchjob.plan.plan import Plan
from batchjob.runner.execute import Execution, backend_config, execute, job_tokenizer
from batchjob.storage.atomic import write_json_atomic
from batchjob.storage.stores import configure as configure_storage
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.tokenizer import PromptTokenizer


class ShardWorker:
    """Opens the job's backend on each shard it is given; outcomes go to the job's parts."""

    def __init__(
        self,
        job: JobConfig,
        layout: OutputLayout,
        manifest: dict,
        text_prompts: bool,
        writer: str,
    ) -> None:
        # nothing that can fail here: an error in run() reaches the driver as the cause
        self.job, self.layout, self.manifest = job, layout, manifest
        configure_storage(job.storage)  # [storage] (s3 endpoint, ...) in this worker process too
        self.text_prompts, self.writer = text_prompts, writer
        self._tokenizer: PromptTokenizer | None = None
        self._loaded = False

    def pid(self) -> int:
        """The worker's process id."""
        return os.getpid()

    def _announce(self) -> None:
        """``<meta>/workers/<writer>.json``: which process on which host this writer is (for
        the operator, and for the tests that kill it); removed when the cluster run ends."""
        info = {"writer": self.writer, "pid": os.getpid(), "host": socket.gethostname()}
        write_json_atomic(
            {**info, "started": time.time()}, workers_dir(self.layout) / (f"{self.writer}.json")
        )

    def run(self, prompts: TokenizedPrompts, plan: Plan) -> Execution:
        """Run ``plan`` over ``prompts``; every finished row is in a part file on return."""
        job = self.job
        if not self._loaded:
            self._announce()
            self._tokenizer = job_tokenizer(job.model, job.sampling, self.text_prompts)
            self._loaded = True
        sink = ResultSink(
            self.layout,
            self.manifest,
            flush_rows=job.output.flush_rows,
            rows_per_file=job.output.rows_per_file,
            extra_columns=job_columns(job.sampling, job.input),
            writer=self.writer,
        )
        return execute(backend_config(job), prompts, plan, sink, self._tokenizer)


def workers_dir(layout: OutputLayout) -> Any:
    """``<meta>/workers``: a Path, or an object-store path (``batchjob.storage.stores``)."""
    return layout.meta / "workers"
