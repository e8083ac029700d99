"""One engine worker of a cluster job: runs shards of the plan into its own part files.

A plain class; the driver makes it a Ray actor (``ray.remote(ShardWorker)``), so this module
imports no Ray. Its part files carry the run's token and its writer id
(``part-000003-1a2b3c4d-w1.parquet``): workers never write the same name, a later run's workers
never write a name of an earlier run's, and a rerun of the job reads every part as done,
whoever wrote it.

A worker never outlives its run's hold on the output (``RunGuard``): before each part file it
checks that the driver process is alive (when it runs on the driver's machine, in its pid
namespace) and that the output's lock still holds its run's token; a watchdog thread makes the
same check every second and ends the worker's process once the run is over. So a worker whose
driver was killed stops within about a second on the driver's machine; on another machine Ray
ends it when it sees the driver gone, and before that it writes no part once a new run holds
the lock. It never creates the parts folder: a run that committed and removed it meanwhile
gets no stray part.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from batchjob.config import JobConfig
from batchjob.errors import EXIT_RUNTIME, BatchJobError
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import ResultSink
from batchjob.outputs.score_columns import job_columns
from batchjob.plan.plan import Plan
from batchjob.runner.execute import Execution, backend_config, execute, job_tokenizer
from batchjob.storage.atomic import write_json_atomic
from batchjob.storage.lock import holder_token
from batchjob.storage.stores import configure as configure_storage
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

WATCH_S = 1.0  # how often a worker's watchdog checks that its run goes on


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class DriverInfo:
    """Where the driver runs: a worker on the same host, in the same pid namespace, can tell
    whether its process is alive."""

    host: str
    pid: int
    pid_namespace: str

    @classmethod
    def here(cls) -> DriverInfo:
        return cls(socket.gethostname(), os.getpid(), _pid_namespace())

    def gone(self) -> bool:
        """True when the driver's process is known to be gone (False: alive, or cannot tell)."""
        if self.host != socket.gethostname() or self.pid_namespace != _pid_namespace():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class RunOverError(BatchJobError, exit_code=EXIT_RUNTIME):
    """This worker's run no longer holds the output (its driver died, or another run took the
    lock): it writes nothing more."""


class RunGuard:
    """The check a worker makes before each part file (``check``) and every ``WATCH_S``."""

    def __init__(self, layout: OutputLayout, token: str, driver: DriverInfo | None) -> None:
        self.layout, self.token, self.driver = layout, token, driver

    def why_over(self) -> str | None:
        """None while the run goes on, else why it is over."""
        if self.driver is not None and self.driver.gone():
            return f"its driver (pid {self.driver.pid} on {self.driver.host}) is gone"
        holder = holder_token(self.layout.lock_file)  # None: unreadable now, ask again later
        if holder is not None and holder != self.token:
            return f"the lock of {self.layout.output} is no longer its run's ({self.token})"
        return None

    def check(self) -> None:
        if (why := self.why_over()) is not None:
            raise RunOverError(f"cluster worker stops: {why}; it writes no more parts")


class ShardWorker:
    """Opens the job's backend on each shard it is given; outcomes go to the job's parts."""

    def __init__(
        self,
        job: JobConfig,
        layout: OutputLayout,
        manifest: dict,
        text_prompts: bool,
        writer: str,
        run: str = "",
        driver: DriverInfo | None = None,
    ) -> None:
        # nothing that can fail here: an error in run() reaches the driver as the cause
        self.job, self.layout, self.manifest = job, layout, manifest
        configure_storage(job.storage)  # [storage] (s3 endpoint, ...) in this worker process too
        self.text_prompts, self.writer, self.run_token = text_prompts, writer, run
        self.guard = RunGuard(layout, run, driver) if run else None
        self._tokenizer: PromptTokenizer | None = None
        self._loaded = False
        self._watchdog: threading.Thread | None = None

    def _watch(self) -> None:
        """End this process once its run is over (the driver died, the lock changed hands)."""
        assert self.guard is not None
        while True:
            time.sleep(WATCH_S)
            try:
                why = self.guard.why_over()
            except Exception:  # a flaky read: look again next time
                continue
            if why is not None:
                log.warning("cluster worker %s stops: %s", self.writer, why)
                os._exit(EXIT_RUNTIME)

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

    def _begin(self) -> None:
        """Before each call's work: the run still holds the output (and is watched from
        now on); the first call announces this writer and loads the tokenizer."""
        if self.guard is not None:
            self.guard.check()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, daemon=True)
                self._watchdog.start()
        if not self._loaded:
            self._announce()
            self._tokenizer = job_tokenizer(self.job.model, self.job.sampling, self.text_prompts)
            self._loaded = True

    def _sink(self) -> ResultSink:
        """A sink writing this writer's part files (checked by the guard before each)."""
        job = self.job
        return ResultSink(
            self.layout,
            self.manifest,
            flush_rows=job.output.flush_rows,
            rows_per_file=job.output.rows_per_file,
            extra_columns=job_columns(
                job.sampling, job.input, job.output.reasoning_parser, job.model.task
            ),
            writer=self.writer,
            run=self.run_token,
            before_write=self.guard.check if self.guard is not None else None,
            own_parts_dir=False,
        )

    def run(self, prompts: TokenizedPrompts, plan: Plan) -> Execution:
        """Run ``plan`` over ``prompts``; every finished row is in a part file on return."""
        self._begin()
        return execute(backend_config(self.job), prompts, plan, self._sink(), self._tokenizer)


def workers_dir(layout: OutputLayout) -> Any:
    """``<meta>/workers``: a Path, or an object-store path (``batchjob.storage.stores``)."""
    return layout.meta / "workers"
