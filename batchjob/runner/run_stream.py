"""`batchjob run` of a dataset over ``scheduler.plan_memory``: partition by partition.

The job's input is read, tokenized and spilled to partitions by its rows' first tokens in one
pass (``plan_stream.spill_input``, as ``batchjob plan`` does); partitions over the budget are
split again (``streamed.fit_partitions``). Then, largest first, each partition is read back
with its rows' settings and adapters, expanded into its requests (every row's samples),
less the results an earlier run wrote (a bitmap of result indices,
``streamed_commit.done_rows``), planned alone (``plan_job``: Eq. 4 order within it) and run
through ``execute`` on one
backend opened once, its results streaming to the job's ``ResultSink`` part files: a kill
anywhere loses nothing, and the rerun skips every row written. The plan file lists the groups
in the order they ran, partition after partition, written once the run is done. The commit
streams one results file at a time (``streamed_commit``), its pass-through columns from the
copy the spill pass wrote (``PassthroughSpill``): the input is read once.

In memory at once: one partition's rows, tokens and plan, and the backend's state for them;
the done bitmap (a bit per result); a results file while committing. Not the dataset's
rows, plan, pass-through columns or results; the rejected rows and the engine's iteration
records go to files in batches as they come (``batchjob.outputs.spilled_records``); a job of
samples maps each row's first result index from a file (``ResultStarts``). Cluster runs run
in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import JobConfig
from batchjob.errors import AllRowsRejectedError
from batchjob.inputs.source import open_input
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import ResultRow, ResultSink
from batchjob.outputs.spilled_records import IterationLog, RejectedSpill
from batchjob.outputs.streamed_commit import ResultIndex, RowBits, bucket_parts, done_rows
from batchjob.plan.build import plan_job
from batchjob.plan.plan import Plan, PlanStats
from batchjob.plan.plan_io import plan_schema, plan_to_table
from batchjob.plan.streamed import fit_partitions
from batchjob.runner.execute import (
    Execution,
    backend_config,
    execute,
    merge,
    open_job_backend,
    select_rows,
)
from batchjob.runner.plan_stream import spill_folder, spill_input
from batchjob.runner.progress import results_phrase
from batchjob.storage.atomic import Target, atomic_open
from batchjob.storage.workdir import owned_workdir
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamedRun:
    """What a partitioned run did, for the report (``pipeline``)."""

    execution: Execution  # the partitions' runs merged; its plan holds only the stats
    results: object  # the committed results path
    rows: dict[str, int]  # total, ok, rejected, skipped, input (``report.summarize``)
    stage_s: dict[str, float]
    partitions: int
    iterations: IterationLog  # the engine's records; the caller closes it after the report


def _report_rejected(
    rejected: RejectedSpill, sink: ResultSink, done: RowBits, index: ResultIndex | None = None
) -> int:
    """The rejected rows not written earlier to ``sink``; returns how many."""
    n = 0
    for chunk in rejected.chunks():
        at = chunk.row_ids if index is None else index.of(chunk.row_ids)
        todo = np.flatnonzero(~done.has(at))
        for i in todo:
            rid = int(chunk.row_ids[i])
            sink.add(ResultRow(rid, None, None, 0, 0, None, chunk.status[i], chunk.message[i]))
        n += len(todo)
    return n


def _all_rejected(rejected: RejectedSpill, num_rows: int) -> str:
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.counts().items()))
    first = rejected.first_message
    return f"every one of the {num_rows} input rows was rejected ({counts}); first: {first}"


def _sum_stats(stats: list[PlanStats]) -> PlanStats:
    def total(f: str) -> int:
        return sum(getattr(s, f) for s in stats)

    logical = total("logical_prefill_tokens")
    single, multi = total("single_level_prefill_tokens"), total("multi_level_prefill_tokens")
    return PlanStats(
        num_requests=total("num_requests"),
        num_groups=total("num_groups"),
        logical_prefill_tokens=logical,
        single_level_prefill_tokens=single,
        multi_level_prefill_tokens=multi,
        saving_ratio_single_level=1.0 - single / logical if logical else 0.0,
        saving_ratio_multi_level=1.0 - multi / logical if logical else 0.0,
    )


def _stats_plan(stats: PlanStats) -> Plan:
    """A Plan with no groups and ``stats``: the merged Execution's (the groups are in the
    plan file)."""
    empty = np.zeros(0, dtype=np.int64)
    return Plan(empty, np.zeros(1, np.int64), empty, empty, np.zeros(0, np.int32), stats)


class _PlanPieces:
    """Each partition's plan as it ran, spilled; then one plan file, partition after
    partition, groups numbered on, positions those of the valid rows in input order."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: list[Path] = []
        self.stats: list[PlanStats] = []
        self.groups = 0

    def add(self, plan: Plan, prompts: TokenizedPrompts, positions: np.ndarray) -> None:
        """``plan`` as it ran over ``prompts`` (or those of them not over the KV budget:
        whole rows dropped), ``positions`` the prompts' request positions."""
        t = plan_to_table(plan)
        t = t.set_column(0, "group", pa.array(t["group"].to_numpy() + self.groups))
        t = t.set_column(2, "position", pa.array(_positions(plan, prompts, positions)))
        path = self.folder / f"ran{len(self.files):05d}.parquet"
        pq.write_table(t, path)
        self.files.append(path)
        self.stats.append(plan.stats)
        self.groups += plan.num_groups

    def write(self, path: Target, stats: PlanStats) -> None:
        schema = plan_schema(stats)
        with atomic_open(path, "wb") as f, pq.ParquetWriter(f, schema) as w:
            for piece in self.files:
                w.write_table(pq.read_table(piece).cast(schema))
            if not self.files:
                w.write_table(schema.empty_table())


def _positions(plan: Plan, prompts: TokenizedPrompts, positions: np.ndarray) -> np.ndarray:
    """int64: the request position of each plan member. ``prompts``' row ids ascend, a row's
    samples side by side; the plan lists a row's requests side by side in the same order
    (``plan.build``), so the k-th member of a run of one row id is that row's k-th request."""
    rid = plan.row_ids
    if not len(rid):
        return np.zeros(0, dtype=np.int64)
    first = np.searchsorted(prompts.row_ids, rid)
    run = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    rank = np.arange(len(rid)) - np.repeat(run, np.diff(np.r_[run, len(rid)]))
    return np.asarray(positions[first + rank], dtype=np.int64)


def _work_parent(layout: OutputLayout) -> Path:
    return layout.meta if isinstance(layout.meta, Path) else Path(tempfile.gettempdir())


def run_partitioned(
    job: JobConfig,
    layout: OutputLayout,
    sink: ResultSink,
    tokenizer: PromptTokenizer | None,
    *,
    progress: bool = False,
    heartbeat_s: float | None = None,
) -> StreamedRun:
    """Run ``job`` partition by partition into ``sink``, then commit (the module doc)."""
    iterations = IterationLog(_work_parent(layout))
    try:
        return _run_partitioned(job, layout, sink, tokenizer, iterations, progress, heartbeat_s)
    except BaseException:
        iterations.close()
        raise


def _run_partitioned(
    job: JobConfig,
    layout: OutputLayout,
    sink: ResultSink,
    tokenizer: PromptTokenizer | None,
    iterations: IterationLog,
    progress: bool,
    heartbeat_s: float | None,
) -> StreamedRun:
    stage: dict[str, float] = {"plan_s": 0.0, "load_s": 0.0}
    dataset = open_input(job.input, job.model, job.sampling)
    cfg = backend_config(job)
    runs: list[Execution] = []
    backend = None
    with spill_folder(layout.meta) as work:
        s = spill_input(job, dataset, work, tokenizer, keep_passthrough=True)
        stage["read_s"], stage["tokenize_s"] = s.read_s, s.tokenize_s
        if len(s.rejected) == s.num_rows:
            raise AllRowsRejectedError(_all_rejected(s.rejected, s.num_rows))
        index = s.index or ResultIndex(s.num_rows)
        done = done_rows(layout, s.num_rows, index)  # results an earlier run wrote
        skipped = done.count()
        rejected_now = _report_rejected(s.rejected, sink, done, index)
        todo, depths, over = fit_partitions(s.spill, s.budget, work)
        todo.sort(key=lambda sp: -int(sp[0].num_tokens[sp[1]]))  # largest first
        log.info(
            "running in %d partitions (key depths %s; %d over the budget)",
            len(todo),
            ",".join(map(str, sorted(depths))),
            over,
        )
        total = s.num_results
        to_run = total - skipped - rejected_now
        if progress or heartbeat_s:
            counted = results_phrase(total, s.num_rows)
            print(
                f"batchjob: {counted}: {to_run} to run in {len(todo)} partitions, {skipped} "
                f"done earlier, {len(s.rejected)} rejected -> {layout.output}",
                file=sys.stderr,
                flush=True,
            )
        pieces = _PlanPieces(work)
        try:
            for spill, p in todo:
                rows = spill.read(p)
                spill.remove(p)
                prompts, positions = rows.requests(s.samples)
                keep = ~done.has(index.of(prompts.row_ids, prompts.sample_index))
                prompts, positions = select_rows(prompts, keep), positions[keep]
                if not len(prompts):
                    continue
                t0 = time.perf_counter()
                plan = plan_job(prompts, job.scheduler)
                stage["plan_s"] += time.perf_counter() - t0
                if backend is None:
                    t0 = time.perf_counter()
                    backend = open_job_backend(cfg, tokenizer, s.model)
                    stage["load_s"] += time.perf_counter() - t0
                ex = execute(
                    cfg,
                    prompts,
                    plan,
                    sink,
                    tokenizer,
                    s.model,
                    backend=backend,
                    progress=progress,
                    heartbeat_s=heartbeat_s,
                )
                iterations.add(ex.run.iterations)  # to a file: not held per partition
                ex = dataclasses.replace(ex, run=dataclasses.replace(ex.run, iterations=[]))
                pieces.add(ex.plan, prompts, positions)
                runs.append(dataclasses.replace(ex, plan=_stats_plan(ex.plan.stats)))  # no rows
        finally:
            if backend is not None:
                backend.close()
            sink.flush()
        stats = _sum_stats(pieces.stats)
        pieces.write(layout.plan_file, stats)
        assert s.passthrough_spill is not None
        passthrough = s.passthrough_spill.tables()  # for the commit: not the input again
    wall = sum(e.run.wall_s for e in runs)
    device = runs[0].device if runs else "none"
    merged = merge(runs, _stats_plan(stats), device, wall)
    stage["load_s"] += merged.load_s
    stage["run_s"] = wall
    stage["calibration_s"] = sum(e.calibration_s for e in runs)  # partitions in turn
    log.info("stage run done in %.2f s (%d partitions)", wall, len(runs))
    n_over = merged.over_budget
    t0 = time.perf_counter()
    with owned_workdir(_work_parent(layout), ".commit-buckets-") as buckets:
        streamed = bucket_parts(layout, sink.schema, buckets, s.num_rows, sink.rows_per_file, index)
        chunks = streamed.chunks(passthrough, s.passthrough)
        results = sink.commit_chunks(chunks, total)
    stage["write_s"] = time.perf_counter() - t0
    rows = {
        "total": total,
        "ok": total - len(s.rejected) - n_over,
        "rejected": len(s.rejected) + n_over,
        "skipped": skipped,
        "input": s.num_rows,
    }
    return StreamedRun(merged, results, rows, stage, len(todo), iterations)
