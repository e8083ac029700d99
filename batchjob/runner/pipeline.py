"""One job end to end: read -> tokenize -> plan -> execute -> write results and report.

``run(job)`` is the Python API under ``batchjob run``. Before any work it checks the output
path, takes the output's lock and compares the job's manifest with what the output holds
(``manifest``): a rerun of the same interrupted job skips the rows already written; another
job's results or parts are refused unless ``output.overwrite``, and even then replaced only at
commit, once the new results are complete (``results``). A results folder holding files
batchjob did not write is refused unless ``output.allow_other_files`` (``ownership``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from batchjob.config import JobConfig
from batchjob.errors import AllRowsRejectedError, ConfigError
from batchjob.inputs.source import open_input
from batchjob.outputs.manifest import difference, manifest, read_manifest
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.ownership import check_output, check_results_folder
from batchjob.outputs.recovery import clean_stale, drop_parts
from batchjob.outputs.report import RunSummary, summarize, write_report
from batchjob.outputs.results import ResultSink
from batchjob.outputs.score_columns import job_columns
from batchjob.outputs.spilled_records import IterationLog
from batchjob.plan.build import plan_job
from batchjob.plan.plan_io import write_plan
from batchjob.runner.execute import Execution, backend_config, execute, job_tokenizer
from batchjob.runner.execute import cap_to_context as cap_to_context
from batchjob.runner.plan_stream import partitioned_reason
from batchjob.runner.prepare import prepare
from batchjob.runner.progress import results_phrase
from batchjob.storage.faults import fault_point
from batchjob.storage.lock import output_lock
from batchjob.storage.stores import ObjectPath
from batchjob.storage.stores import configure as configure_storage
from batchjob.tokenize.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    results_path: Path | ObjectPath  # ObjectPath: on an object store (batchjob.storage.stores)
    report_paths: dict[str, Path | ObjectPath]
    summary: RunSummary | None  # None when the job was already complete


def _foreign(layout: OutputLayout, what: str, why: str) -> ConfigError:
    return ConfigError(
        f"output.path: {layout.output} {what} of another job: {why}. To replace them rerun "
        "with --set output.overwrite=true (they stay until the new results are complete); "
        "to keep them choose another output.path"
    )


def _resume_or_start(layout: OutputLayout, this: dict, overwrite: bool) -> bool:
    """False when the output already holds this job's complete results; True to run (resuming
    this job's parts if any). Another job's output: ConfigError, or with ``overwrite`` its
    parts are dropped and its results kept until the commit replaces them."""
    if layout.has_parts():
        why = difference(this, read_manifest(layout.parts_manifest))
        if why is None:
            return True  # resume: an interrupted overwrite run keeps its progress too
        if not overwrite:
            raise _foreign(layout, "holds unfinished parts", why)
    if layout.store.exists(layout.parts):  # another job's parts, or a manifest with no rows
        drop_parts(layout)
    if layout.complete() and not overwrite:
        why = difference(this, read_manifest(layout.manifest_file))
        if why is None:
            return False
        raise _foreign(layout, "holds results", why)
    return True


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _identity(this: dict, started: str) -> dict:
    """The report's job identity: the manifest's description + version and times."""
    return {
        **this["job"],
        "batchjob_version": this["fingerprint"]["batchjob.version"],
        "input_files": len(this["fingerprint"]["input.files"]),
        "num_rows": this["fingerprint"]["input.num_rows"],
        "started_at": started,
        "finished_at": _utc_now(),
    }


def run(job: JobConfig, progress: bool = True, heartbeat_s: float | None = None) -> JobResult:
    """Run ``job``; returns where results and report went and the summary.

    ``heartbeat_s``: print a progress line on stderr this often (the operator's log)."""
    t_job = time.perf_counter()
    started = _utc_now()
    configure_storage(job.storage)  # object-store settings, for a job not made by load_job
    layout = OutputLayout.of(job.output)
    dataset = open_input(job.input)  # metadata only: files and row count for the manifest
    check_output(layout, job.input.path, dataset.files)
    layout.prepare()
    token = uuid.uuid4().hex[:8]  # this run's: in the lock and in every part name
    with output_lock(layout.lock_file, layout.output, token):
        clean_stale(layout)
        this = manifest(job.to_dict(), job.source, dataset.files, dataset.num_rows)
        if not _complete_already(layout, this):
            check_results_folder(layout)  # files batchjob did not write: refused, never lost
        if not _resume_or_start(layout, this, job.output.overwrite):
            return JobResult(layout.output, {}, None)  # complete already: idempotent
        return _run_locked(
            job,
            layout,
            this,
            progress,
            t_job,
            heartbeat_s,
            started,
            dataset.prompt_is_text,
            run_token=token,
            streamed=_over_plan_memory(job, dataset) and _partitions_here(job, layout),
        )


def _partitions_here(job: JobConfig, layout: OutputLayout) -> bool:
    """A job over its planning budget runs in partitions: in this process, or on a cluster
    whose workers plan them (``cluster.partitioned``) unless the job cannot."""
    if job.cluster.address == "none":
        return True
    from batchjob.runner.cluster.partitioned import cannot_partition

    if (why := cannot_partition(job, layout)) is not None:
        log.warning("%s: the driver plans it in memory", why)
        return False
    return True


def _over_plan_memory(job: JobConfig, dataset) -> bool:
    """The job plans over ``scheduler.plan_memory`` and can run in partitions."""
    why = partitioned_reason(job, dataset)
    if why is not None:
        log.info("%s: running partition by partition", why)
    return why is not None


def _complete_already(layout: OutputLayout, this: dict) -> bool:
    """The output holds this job's complete results and no parts: nothing will be written."""
    if not layout.complete() or layout.has_parts():
        return False
    return difference(this, read_manifest(layout.manifest_file)) is None


def _rejected_summary(loaded) -> str:
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(loaded.rejected.counts().items()))
    first = loaded.rejected.message[0] if len(loaded.rejected) else ""
    return f"every one of the {loaded.num_rows} input rows was rejected ({counts}); first: {first}"


def _run_locked(
    job: JobConfig,
    layout: OutputLayout,
    this: dict,
    progress: bool,
    t_job: float,
    heartbeat_s: float | None = None,
    started: str = "",
    text_prompts: bool = True,
    run_token: str = "",
    streamed: bool = False,
) -> JobResult:
    stage: dict[str, float] = {}

    tokenizer = job_tokenizer(
        job.model, job.sampling, text_prompts
    )  # once: encodes text, decodes outputs
    # read + tokenize (on a cluster: Ray tasks over the input's row groups); the model folder
    # is read once, for the later stages
    if streamed:
        return _run_streamed(
            job,
            layout,
            this,
            progress,
            t_job,
            heartbeat_s,
            started,
            run_token,
            tokenizer,
            text_prompts,
        )
    prep = prepare(job, tokenizer, on_cluster=job.cluster.address != "none")
    loaded, model = prep.loaded, prep.model
    stage["read_s"], stage["tokenize_s"] = loaded.read.seconds, loaded.tokenize.seconds
    log.info("stage tokenize done (read + tokenize: %d rows)", loaded.num_rows)
    if len(loaded.prompts) == 0:
        raise AllRowsRejectedError(_rejected_summary(loaded))  # nothing written: fix the data
    sink = _job_sink(job, layout, this, run_token)
    done = sink.done_keys()
    prompts = prep.requests(done)  # every row's samples, less those done earlier
    prep.report_rejected(sink, done)  # one result row per rejected row
    expected = prep.expected  # result rows: one per sample or rejected row
    counted = results_phrase(expected, loaded.num_rows)  # as the end line counts them

    t0 = time.perf_counter()
    plan = plan_job(prompts, job.scheduler)
    stage["plan_s"] = time.perf_counter() - t0
    log.info("stage plan done in %.2f s", stage["plan_s"])

    if job.cluster.address == "none":
        ex = execute(
            backend_config(job),
            prompts,
            plan,
            sink,
            tokenizer,
            model,
            plan_file=layout.plan_file,
            progress=progress,
            heartbeat_s=heartbeat_s,
            headline=lambda to_run, n_over: (
                f"{counted}: {to_run} to run, {len(done)} done earlier, "
                f"{len(loaded.rejected) + n_over} rejected -> {layout.output}"
            ),
        )
    else:  # the plan split over the workers of a Ray cluster (Ray imported only here)
        from batchjob.runner.cluster import run_on_cluster

        write_plan(plan, layout.plan_file)
        ex = run_on_cluster(
            job, layout, this, prompts, plan, text_prompts, progress, heartbeat_s, sink.run
        )
    n_over = ex.over_budget
    stage["load_s"] = ex.load_s
    stage["run_s"] = ex.run.wall_s
    stage["calibration_s"] = ex.calibration_s  # of load_s, and of the run excluded from run_s
    log.info("stage run done in %.2f s", stage["run_s"])

    t0 = time.perf_counter()
    results_path = sink.finalize(loaded.passthrough, expected_rows=expected)
    stage["write_s"] = time.perf_counter() - t0
    log.info("stage write done in %.2f s", stage["write_s"])
    rows = {
        "total": expected,
        "ok": expected - len(loaded.rejected) - n_over,
        "rejected": len(loaded.rejected) + n_over,
        "skipped": len(done),
        "input": loaded.num_rows,
    }
    return _report(job, layout, this, sink, ex, rows, stage, results_path, t_job, started)


def _job_sink(job: JobConfig, layout: OutputLayout, this: dict, run_token: str) -> ResultSink:
    return ResultSink(
        layout,
        this,
        run=run_token,
        flush_rows=job.output.flush_rows,
        rows_per_file=job.output.rows_per_file,
        extra_columns=job_columns(
            job.sampling, job.input, job.output.reasoning_parser, job.model.task
        ),
    )


def _run_streamed(
    job: JobConfig,
    layout: OutputLayout,
    this: dict,
    progress: bool,
    t_job: float,
    heartbeat_s: float | None,
    started: str,
    run_token: str,
    tokenizer: PromptTokenizer | None,
    text_prompts: bool = True,
) -> JobResult:
    """A job over ``scheduler.plan_memory``: read, planned and run partition by partition,
    committed a results file at a time (``run_stream``; on a cluster,
    ``cluster.partitioned``)."""
    from batchjob.runner.run_stream import StreamedRun, run_partitioned

    sink = _job_sink(job, layout, this, run_token)
    done: StreamedRun
    if job.cluster.address == "none":
        done = run_partitioned(
            job, layout, sink, tokenizer, progress=progress, heartbeat_s=heartbeat_s
        )
    else:  # each worker plans and runs its partitions (Ray imported only here)
        from batchjob.runner.cluster.partitioned import run_partitioned_on_cluster

        done = run_partitioned_on_cluster(
            job,
            layout,
            this,
            sink,
            tokenizer,
            text_prompts,
            run_token=run_token,
            progress=progress,
            heartbeat_s=heartbeat_s,
        )
    log.info("stage write done in %.2f s", done.stage_s["write_s"])
    try:
        return _report(
            job,
            layout,
            this,
            sink,
            done.execution,
            done.rows,
            done.stage_s,
            done.results,
            t_job,
            started,
            iterations=done.iterations,
        )
    finally:
        done.iterations.close()


def _report(
    job: JobConfig,
    layout: OutputLayout,
    this: dict,
    sink: ResultSink,
    ex: Execution,
    rows: dict[str, int],
    stage: dict[str, float],
    results_path,
    t_job: float,
    started: str,
    iterations: IterationLog | None = None,
) -> JobResult:
    """The committed run's report (and OpenAI Batch lines); then the parts go.
    ``iterations``: a partitioned run's records, spilled (``ex.run.iterations`` is empty)."""
    plan = ex.plan
    summary = summarize(
        ex.run,
        prompt_tokens=ex.prompt_tokens,
        generated_tokens=ex.generated_tokens,
        requests_run=ex.requests_run,
        rows=rows,
        plan_ratios=(plan.stats.saving_ratio_single_level, plan.stats.saving_ratio_multi_level),
        total_s=time.perf_counter() - t_job,
        stage_s=stage,
        policy=job.scheduler.policy,
        device=ex.device,
        results=results_path,
        iterations=iterations,
    )
    summary = dataclasses.replace(summary, job=_identity(this, started), task=job.model.task)
    fault_point("report")
    paths = write_report(summary, ex.run, layout.report_file, iterations)
    if job.output.format == "openai-jsonl":  # from the committed results: a kill before
        from batchjob.outputs.openai_batch import write_responses  # cleanup redoes it

        assert isinstance(results_path, Path)  # refused at load for an object store
        paths["openai_jsonl"] = write_responses(
            job.input, job.model, layout.jsonl_file, results_path
        )
    sink.cleanup()  # after the report: a kill before here re-commits and re-reports on rerun
    return JobResult(results_path, paths, summary)
