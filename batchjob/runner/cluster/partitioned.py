"""A job over ``scheduler.plan_memory`` on a Ray cluster: each worker plans the partitions it runs.

1. **Spill on the workers.** The input's row groups are cut into one slice per worker
   (``read.fragments``, ``read.group``: consecutive, about equal rows); a Ray task per slice
   reads, tokenizes and spills it by its rows' first tokens (``plan_stream.spill_input``, with
   the partition count of the whole input) into its own folder under the driver's spill
   folder (``<meta>/.plan-spill-*/rNNNNN/``), and returns per-partition row, token and
   decode counts and its rejected rows; a run's tasks also keep their rows' pass-through
   columns there, for the commit. A task retried by Ray starts its folder over. An
   OpenAI JSONL input (no row groups) is spilled by the driver itself, streaming.
2. **Assign by cost.** Partition ``p`` is the union of every slice's ``p`` files, in slice
   order (row-id order). Its estimated cost is the shard balancer's
   (``batchjob.plan.shard``): prompt tokens + ``DECODE_WEIGHT`` x decode tokens (sharing is
   not known before planning). Partitions go largest first to the next idle worker (LPT,
   online: a worker that finishes early takes the next one).
3. **Plan and run on the worker.** A ``PartitionWorker`` reads the partition's files (one
   partition over the budget is first split by a deeper key, ``streamed.fit_partitions``),
   drops the rows an earlier run wrote (the done bitmap the driver sent), plans it
   (``plan_job``) and runs it on a backend opened once per worker, its rows going to its own
   part files as a ``ShardWorker``'s do. It writes the plan of what it ran beside the spill.
4. **Commit on the driver**, a results file at a time, as a single-process partitioned run
   does (``streamed_commit``), the pass-through columns taken from the slices' copies (the
   input is read once): the same result files. The plan file lists the groups in the
   order they ran, partition after partition.

A worker that dies fails its call; its partition is queued again, flagged so that its next
worker reads the done rows from the parts (the rows the dead one wrote are not redone), on a
replacement worker (``cluster.max_restarts``) or the next idle one. A killed driver leaves
parts and its spill folder; the rerun removes the folder, spills again and skips every row
written: exactly once either way.

In the driver's memory: the per-partition counts (a few integers per partition), the done
bitmap (a bit per input row), the rejected rows, one results file while committing. Not the
rows, tokens, plans or results. ``plan_partitioned_on_cluster`` is the same without running:
the workers plan and spill their partitions' groups, the driver merges them into the plan
file in Eq. 4 order (``streamed``), the plan ``batchjob plan`` writes in one process.

The spill folder must be visible to every worker, as the parts folder is: a local output
path on a filesystem the nodes share. Ray is imported only when this runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.backends.base import Backend
from batchjob.config import JobConfig
from batchjob.config.per_row import ROW_SETTING_COLUMNS
from batchjob.errors import AllRowsRejectedError, BatchJobError
from batchjob.inputs.parquet import InputDataset, RejectedRows
from batchjob.inputs.prompt_builder import make_builder
from batchjob.inputs.source import open_input
from batchjob.model.info import ModelInfo, model_info_for
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import ResultRow, ResultSink
from batchjob.outputs.spilled_records import IterationLog, RejectedSpill
from batchjob.outputs.streamed_commit import RowBits, bucket_parts, done_rows, passthrough_tables
from batchjob.plan.budget import budget_of, num_partitions, plan_bytes
from batchjob.plan.build import plan_job
from batchjob.plan.partition import FIRST_DEPTH, ROW, PartitionSpill, Rows
from batchjob.plan.plan import PlanStats
from batchjob.plan.plan_io import plan_schema, plan_to_table
from batchjob.plan.shard import DECODE_WEIGHT
from batchjob.plan.streamed import (
    DEPTHS,
    PartPlan,
    StreamedPlan,
    _plan_part,
    _Totals,
    _write,
    fit_partitions,
)
from batchjob.runner.cluster.driver import (
    _Driver,
    _first_line,
    _import_ray,
    _Slot,
    connect,
    disconnect,
    runtime_options,
)
from batchjob.runner.cluster.read import FragmentDataset, _fields, fragments, group
from batchjob.runner.cluster.worker import ShardWorker
from batchjob.runner.execute import (
    Execution,
    backend_config,
    execute,
    merge,
    open_job_backend,
    select_rows,
)
from batchjob.runner.plan_stream import (
    PASSTHROUGH_FILE,
    PartitionedPlan,
    estimated_tokens,
    spill_folder,
    spill_input,
)
from batchjob.runner.progress import results_phrase
from batchjob.runner.run_stream import StreamedRun, _stats_plan, _sum_stats, _work_parent
from batchjob.storage.atomic import Target, atomic_open
from batchjob.storage.stores import configure as configure_storage
from batchjob.storage.workdir import owned_workdir
from batchjob.timing import StageTiming
from batchjob.tokenize.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

PARTS_PER_WORKER = 4  # at least this many partitions per worker: the LPT queue balances
REJECTED_FILE = "rejected-rows.parquet"  # a slice's rejected rows, in its folder
RESPLIT_CHUNK = 1 << 16  # rows per read while gathering a partition over the budget


def cluster_partitions(dataset: InputDataset, budget: int, workers: int) -> int:
    """The first split's partition count: the budget's, and at least ``PARTS_PER_WORKER``
    per worker."""
    n = num_partitions(dataset.num_rows, estimated_tokens(dataset), budget)
    return min(1 << 16, max(n, PARTS_PER_WORKER * workers))


# --- 1. spill on the workers -----------------------------------------------------------


@dataclass(frozen=True)
class SliceSpill:
    """What one slice's task spilled (``spill_slice``)."""

    folder: str
    num_rows: np.ndarray  # int64 [P]: valid rows per partition
    num_tokens: np.ndarray  # int64 [P]
    decode: np.ndarray  # int64 [P]: the rows' max_tokens (context-capped)
    valid: int  # valid rows in the slice
    rows: int  # input rows in the slice, valid and rejected
    rejected: int
    read_s: float
    tokenize_s: float
    passthrough: pa.Schema
    pid: int = 0


def _decode_sums(spill: PartitionSpill) -> np.ndarray:
    """int64 [P]: each partition's max_tokens, from its row records (not its tokens)."""
    out = np.zeros(spill.num_parts, dtype=np.int64)
    for p in np.flatnonzero(spill.num_rows):
        rows = np.fromfile(spill.path(int(p), "rows"), dtype=ROW)
        out[p] = int(rows["max_tokens"].astype(np.int64).sum())
    return out


def _rejected_rows(rejected: Any) -> RejectedRows:
    """``spill_input``'s rejected rows as one ``RejectedRows`` (it may hold them spilled)."""
    if isinstance(rejected, RejectedRows):
        return rejected
    return RejectedRows.concat(list(rejected.chunks()))


def _spill(
    job: JobConfig,
    dataset: InputDataset,
    folder: Path,
    num_parts: int,
    tok=None,
    keep_passthrough: bool = False,
):
    shutil.rmtree(folder, ignore_errors=True)  # a retried task starts its slice over
    folder.mkdir(parents=True)
    s = spill_input(
        job, dataset, folder, tok, num_parts=num_parts, keep_passthrough=keep_passthrough
    )
    rejected = _rejected_rows(s.rejected)
    pq.write_table(rejected.to_arrow(), folder / REJECTED_FILE)
    return SliceSpill(
        str(folder),
        s.spill.num_rows.copy(),
        s.spill.num_tokens.copy(),
        _decode_sums(s.spill),
        s.num_rows - len(rejected),
        s.num_rows,
        len(rejected),
        s.read_s,
        s.tokenize_s,
        s.passthrough,
        os.getpid(),
    )


def spill_slice(
    job: JobConfig,
    fields: dict,
    has_builder: bool,
    frags: tuple,
    folder: str,
    num_parts: int,
    keep_passthrough: bool,
) -> SliceSpill:
    """One Ray task: read, tokenize and spill the rows of ``frags`` under ``folder``
    (``keep_passthrough``: their pass-through columns too, for the commit)."""
    configure_storage(job.storage)
    builder = make_builder(job.input, job.model) if has_builder else None
    part = FragmentDataset(**{**fields, "builder": builder, "fragments": frags})
    return _spill(job, part, Path(folder), num_parts, keep_passthrough=keep_passthrough)


def spill_on_cluster(
    ray,
    job: JobConfig,
    dataset: InputDataset,
    root: Path,
    num_parts: int,
    tokenizer=None,
    keep_passthrough: bool = False,
) -> list[SliceSpill]:
    """Every slice spilled under ``root/rNNNNN`` (slice order = row-id order);
    ``keep_passthrough``: each slice's pass-through columns too (``slice_passthrough``)."""
    if job.input.path.endswith(".jsonl"):  # no row groups: one stream, here
        log.info("read + tokenize + spill in this process (OpenAI JSONL input)")
        return [_spill(job, dataset, root / "r00000", num_parts, tokenizer, keep_passthrough)]
    tasks = group(fragments(dataset), job.cluster.workers)
    task = ray.remote(spill_slice).options(**runtime_options())
    fields = _fields(dataset) | {"builder": None}
    has_builder = dataset.builder is not None
    refs = [
        task.remote(
            job, fields, has_builder, frags, str(root / f"r{i:05d}"), num_parts, keep_passthrough
        )
        for i, frags in enumerate(tasks)
    ]
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BatchJobError):
            raise cause from None  # a corrupt file, a bad column: its own exit code
        raise


def slice_passthrough(slices: list[SliceSpill]) -> Iterator[pa.Table]:
    """The slices' pass-through columns in row-id order, every file opened now (so they read
    on after the spill folder is removed)."""
    opened = [passthrough_tables(Path(s.folder) / PASSTHROUGH_FILE) for s in slices]
    return itertools.chain.from_iterable(opened)


def _slice_rejected(slices: list[SliceSpill]):
    """Each slice's rejected rows (``RejectedRows``), one slice at a time."""
    for s in slices:
        if s.rejected:
            t = pq.read_table(Path(s.folder) / REJECTED_FILE)
            yield RejectedRows(
                t["row_id"].to_numpy().astype(np.int64),
                tuple(t["status"].to_pylist()),
                tuple(t["message"].to_pylist()),
            )


# --- 2. the work items ----------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One spill's share of a partition: partition ``part`` of a ``PartitionSpill``."""

    folder: str
    part: int
    rows: int
    tokens: int
    position: int  # added to its rows' positions (a slice's: the valid rows before it)
    num_parts: int
    name: str = "p"
    depth: int = FIRST_DEPTH

    def spill(self) -> PartitionSpill:
        spill = PartitionSpill(Path(self.folder), self.num_parts, self.depth, self.name)
        spill.num_rows[self.part], spill.num_tokens[self.part] = self.rows, self.tokens
        return spill

    def read(self) -> Rows:
        rows = self.spill().read(self.part)
        rows.rows["position"] += self.position
        return rows

    def chunks(self, rows_per_chunk: int) -> Iterator[Rows]:
        for chunk in self.spill().chunks(self.part, rows_per_chunk):
            chunk.rows["position"] += self.position
            yield chunk

    def remove(self) -> None:
        self.spill().remove(self.part)


@dataclass
class PartitionItem:
    name: str  # p17, p17.3 (sub-partition 3 of p17)
    pieces: list[Piece]
    cost: float
    split: bool = False  # over the budget: a worker splits it into new items first
    rescan: bool = False  # a worker died on it: read the done rows from the parts again

    @property
    def what(self) -> str:
        return f"partition {self.name}"


def work_items(slices: list[SliceSpill], num_parts: int, budget: int) -> list[PartitionItem]:
    """The non-empty partitions, most costly first."""
    starts = np.cumsum([0] + [s.valid for s in slices])
    rows = np.sum([s.num_rows for s in slices], axis=0)
    tokens = np.sum([s.num_tokens for s in slices], axis=0)
    cost = np.sum([s.num_tokens + DECODE_WEIGHT * s.decode for s in slices], axis=0)
    items = []
    for p in np.argsort(-cost, kind="stable"):
        if not rows[p]:
            continue
        pieces = [
            Piece(
                s.folder,
                int(p),
                int(s.num_rows[p]),
                int(s.num_tokens[p]),
                int(starts[i]),
                num_parts,
            )
            for i, s in enumerate(slices)
            if s.num_rows[p]
        ]
        over = plan_bytes(int(rows[p]), int(tokens[p])) > budget
        items.append(PartitionItem(f"p{p}", pieces, float(cost[p]), split=over))
    return items


def _concat(parts: list[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    return Rows(np.concatenate([r.rows for r in parts]), np.concatenate([r.tokens for r in parts]))


def split_item(item: PartitionItem, budget: int, folder: Path) -> tuple[list[PartitionItem], int]:
    """``item`` (over ``budget``) split by a deeper key (``streamed.fit_partitions``) into
    new items under ``folder``; -> (items, how many are still over the budget)."""
    whole = PartitionSpill(folder, 1, name="w")
    for piece in item.pieces:
        for chunk in piece.chunks(RESPLIT_CHUNK):
            whole.add_to(chunk, chunk.offsets, np.zeros(len(chunk.rows), dtype=np.int64))
    todo, _, over = fit_partitions(whole, budget, folder)
    out = []
    for k, (spill, q) in enumerate(todo):
        decode = int(_decode_sums(spill)[q])
        piece = Piece(
            str(spill.folder),
            q,
            int(spill.num_rows[q]),
            int(spill.num_tokens[q]),
            0,
            spill.num_parts,
            spill.name,
            spill.depth,
        )
        cost = piece.tokens + DECODE_WEIGHT * decode
        out.append(PartitionItem(f"{item.name}.{k}", [piece], float(cost)))
    return out, over


# --- 3. the workers -------------------------------------------------------------------


@dataclass
class PartitionDone:
    """What a worker did with one item: split it into new items, or planned (and ran) it."""

    name: str
    writer: str
    seconds: float  # planning (or splitting)
    split_into: list[PartitionItem] = field(default_factory=list)
    execution: Execution | None = None  # run mode; its plan holds only the stats
    ran: str = ""  # run mode: the plan that ran (a Parquet file), "" when nothing ran
    stats: PlanStats | None = None
    planned: PartPlan | None = None  # plan mode
    totals: Any = None  # plan mode: the partition's ``streamed._Totals``
    size: tuple[int, int] = (0, 0)  # (rows, tokens)
    over_budget: int = 0
    depth: int = FIRST_DEPTH


class PartitionWorker(ShardWorker):
    """A cluster worker that splits, plans and runs the partitions it is given, on one
    backend opened at its first run (``run_partition``), or only plans them
    (``plan_partition``)."""

    def __init__(
        self,
        job: JobConfig,
        layout: OutputLayout,
        manifest: dict,
        text_prompts: bool,
        writer: str,
        run: str = "",
        driver=None,
        done: RowBits | None = None,
        num_rows: int = 0,
        work: str = "",
    ) -> None:
        super().__init__(job, layout, manifest, text_prompts, writer, run, driver)
        self.done = done if done is not None else RowBits(num_rows)
        self.num_rows = num_rows
        self.work = Path(work)
        self.budget = budget_of(job.scheduler.plan_memory)
        self._backend: Backend | None = None
        self._model: ModelInfo | None = None

    def _folder(self, kind: str, item: PartitionItem) -> Path:
        folder = self.work / f"{kind}-{item.name}-{self.writer}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def split_partition(self, item: PartitionItem) -> PartitionDone:
        """``item``, over the budget, split by a deeper key into new items."""
        if self.guard is not None:
            self.guard.check()
        t0 = time.perf_counter()
        items, over = split_item(item, self.budget, self._folder("s", item))
        return PartitionDone(
            item.name, self.writer, time.perf_counter() - t0, items, over_budget=over
        )

    def run_partition(self, item: PartitionItem) -> PartitionDone:
        """Plan and run ``item``'s rows not written yet; every finished row is in a part
        file on return."""
        self._begin()
        job = self.job
        cfg = backend_config(job)
        done = done_rows(self.layout, self.num_rows) if item.rescan else self.done
        rows = _concat([p.read() for p in item.pieces])
        out = PartitionDone(item.name, self.writer, 0.0, size=(len(rows.rows), len(rows.tokens)))
        prompts = select_rows(rows.prompts(), ~done.has(rows.rows["row_id"]))
        if not len(prompts):
            return out
        t0 = time.perf_counter()
        plan = plan_job(prompts, job.scheduler)
        out.seconds = time.perf_counter() - t0
        if self._backend is None:
            if self._model is None:
                self._model = model_info_for(job.model, job.engine.backend)
            self._backend = open_job_backend(cfg, self._tokenizer, self._model)
        ex = execute(
            cfg, prompts, plan, self._sink(), self._tokenizer, self._model, backend=self._backend
        )
        path = self._folder("ran", item) / "plan.parquet"
        out.ran = str(self._write_ran(ex, rows, path))
        out.stats = ex.plan.stats
        out.execution = dataclasses.replace(ex, plan=_stats_plan(ex.plan.stats))
        return out

    @staticmethod
    def _write_ran(ex: Execution, rows: Rows, path: Path) -> Path:
        """The plan that ran, positions those of the input's valid rows."""
        plan = ex.plan
        t = plan_to_table(plan)
        at = np.searchsorted(rows.rows["row_id"], plan.row_ids)  # row ids ascending
        t = t.set_column(2, "position", pa.array(rows.rows["position"][at].astype(np.int64)))
        pq.write_table(t, path)
        return path

    def plan_partition(self, item: PartitionItem) -> PartitionDone:
        """Plan ``item`` without running it: its groups spilled for the driver's merge."""
        t0 = time.perf_counter()
        rows = _concat([p.read() for p in item.pieces])
        totals = _Totals()
        prefix = self._folder("plan", item) / "plan"
        planned = _plan_part(rows, self.job.scheduler, prefix, totals)
        size = (len(rows.rows), len(rows.tokens))
        return PartitionDone(
            item.name,
            self.writer,
            time.perf_counter() - t0,
            planned=planned,
            totals=totals,
            size=size,
            over_budget=int(plan_bytes(*size) > self.budget),
            depth=item.pieces[0].depth,
        )

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


# --- the driver -----------------------------------------------------------------------


class _PartitionDriver(_Driver):
    """The partitions queued by cost over ``cluster.workers`` ``PartitionWorker`` actors."""

    def __init__(self, ray, job, layout, manifest, text, token, done_ref, num_rows, work, method):
        super().__init__(ray, job, layout, manifest, text, token)
        self.actor_cls = ray.remote(PartitionWorker)
        self.done_ref, self.num_rows, self.work, self.method = done_ref, num_rows, work, method
        self.splits: list[PartitionDone] = []

    def _actor_args(self, slot: _Slot) -> tuple:
        return (*super()._actor_args(slot), self.done_ref, self.num_rows, str(self.work))

    def run_items(self, items: list[PartitionItem]) -> list[PartitionDone]:
        queue: deque[PartitionItem] = deque(items)
        results: list[PartitionDone] = []

        def submit(slot: _Slot, item: PartitionItem) -> Any:
            return getattr(slot.actor, "split_partition" if item.split else self.method).remote(
                item
            )

        self.dispatch(
            queue,
            submit=submit,
            done=lambda slot, item, done: self._finished(item, done, queue, results),
            lost=lambda slot, item, err: self._lost_item(slot, item, queue, err),
            waiting=lambda running: self._say(len(queue), results, running),
            left=lambda: f"{len(queue)} partitions",
        )
        return results

    def _finished(self, item: PartitionItem, done: PartitionDone, queue, results) -> None:
        """A worker's answer: new items queued by cost (a split), or a partition done; the
        item's spilled rows go either way."""
        if item.split:
            log.info(
                "cluster: %s split into %d on %s", item.what, len(done.split_into), done.writer
            )
            if done.over_budget:
                log.warning(
                    "%d partitions of %s exceed scheduler.plan_memory even split by their "
                    "first %d tokens (rows identical that far); planned whole",
                    done.over_budget,
                    item.what,
                    max(DEPTHS),
                )
            self.splits.append(done)
            merged = sorted([*queue, *done.split_into], key=lambda i: -i.cost)
            queue.clear()
            queue.extend(merged)
        else:
            log.info("cluster: %s done on %s", item.what, done.writer)
            results.append(done)
        for piece in item.pieces:
            piece.remove()

    def _lost_item(self, slot: _Slot, item: PartitionItem, queue, err: Exception) -> None:
        log.warning(
            "cluster: worker %s died (%s); %s run again", slot.writer, _first_line(err), item.what
        )
        queue.appendleft(dataclasses.replace(item, rescan=True))

    def _say(self, queued: int, results: list[PartitionDone], running: dict) -> None:
        if self.heartbeat:
            lost = sum(s.restarts + (s.actor is None) for s in self.slots)
            self.heartbeat.say(
                f"cluster: {len(results)} partitions done, {queued} queued, {len(running)} "
                f"workers busy, {lost} workers lost so far"
            )


def _stage_times(slices: list[SliceSpill], wall: float) -> tuple[float, float]:
    """The parallel read + tokenize stage's wall time, split in the tasks' ratio."""
    read = sum(s.read_s for s in slices)
    tok = sum(s.tokenize_s for s in slices)
    share = read / (read + tok) if read + tok > 0 else 0.0
    return wall * share, wall * (1 - share)


def _unify(slices: list[SliceSpill]) -> pa.Schema:
    schema = slices[0].passthrough
    for s in slices[1:]:
        schema = pa.unify_schemas([schema, s.passthrough], promote_options="permissive")
    return schema


def _write_plan_pieces(done: list[PartitionDone], path: Target, stats: PlanStats) -> None:
    """The plan file: what ran, partition after partition in the order they finished."""
    schema = plan_schema(stats)
    groups = 0
    with atomic_open(path, "wb") as f, pq.ParquetWriter(f, schema) as w:
        for d in done:
            if not d.ran:
                continue
            t = pq.read_table(d.ran)
            g = t["group"].to_numpy()
            t = t.set_column(0, "group", pa.array(g + groups))
            groups += int(g.max()) + 1 if len(g) else 0
            w.write_table(t.cast(schema))
        if not groups:
            w.write_table(schema.empty_table())


def plan_seconds(done: list[PartitionDone]) -> dict[str, float]:
    """Planning seconds per writer (splitting partitions over the budget included)."""
    out: dict[str, float] = {}
    for d in done:
        out[d.writer] = out.get(d.writer, 0.0) + d.seconds
    return out


def _log_planning(done: list[PartitionDone]) -> None:
    count: dict[str, int] = {}
    for d in done:
        count[d.writer] = count.get(d.writer, 0) + 1
    per = plan_seconds(done)
    log.info(
        "cluster: planning per worker: %s",
        ", ".join(f"{w} {per[w]:.2f} s ({count[w]} items)" for w in sorted(per)),
    )


def run_partitioned_on_cluster(
    job: JobConfig,
    layout: OutputLayout,
    manifest: dict,
    sink: ResultSink,
    tokenizer: PromptTokenizer | None,
    text_prompts: bool,
    *,
    run_token: str = "",
    progress: bool = False,
    heartbeat_s: float | None = None,
) -> StreamedRun:
    """Run ``job`` (over ``scheduler.plan_memory``) on the cluster, each worker planning the
    partitions it runs; then commit (the module doc)."""
    iterations = IterationLog(_work_parent(layout))
    try:
        return _run_on_cluster(
            job,
            layout,
            manifest,
            sink,
            tokenizer,
            text_prompts,
            iterations,
            run_token,
            progress,
            heartbeat_s,
        )
    except BaseException:
        iterations.close()
        raise


def _run_on_cluster(
    job: JobConfig,
    layout: OutputLayout,
    manifest: dict,
    sink: ResultSink,
    tokenizer: PromptTokenizer | None,
    text_prompts: bool,
    iterations: IterationLog,
    run_token: str,
    progress: bool,
    heartbeat_s: float | None,
) -> StreamedRun:
    from batchjob.runner.heartbeat import Heartbeat

    stage: dict[str, float] = {"load_s": 0.0}
    dataset = open_input(job.input, job.model, job.sampling)
    done = done_rows(layout, dataset.num_rows)
    skipped = done.count()
    budget = budget_of(job.scheduler.plan_memory)
    num_parts = cluster_partitions(dataset, budget, job.cluster.workers)
    ray = _import_ray()
    started = connect(ray, job.cluster)
    try:
        with spill_folder(layout.meta) as work:
            t0 = time.perf_counter()
            slices = spill_on_cluster(ray, job, dataset, work, num_parts, tokenizer, True)
            passthrough = slice_passthrough(slices)  # for the commit: not the input again
            stage["read_s"], stage["tokenize_s"] = _stage_times(slices, time.perf_counter() - t0)
            num_rows = sum(s.rows for s in slices)
            n_rejected = sum(s.rejected for s in slices)
            if n_rejected == num_rows:
                rejected = RejectedRows.concat(list(_slice_rejected(slices)))
                counts = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.counts().items()))
                first = rejected.message[0] if len(rejected) else ""
                raise AllRowsRejectedError(
                    f"every one of the {num_rows} input rows was rejected ({counts}); "
                    f"first: {first}"
                )
            rejected_now = 0
            for rej in _slice_rejected(slices):
                for i in np.flatnonzero(~done.has(rej.row_ids)):
                    rid = int(rej.row_ids[i])
                    sink.add(ResultRow(rid, None, None, 0, 0, None, rej.status[i], rej.message[i]))
                    rejected_now += 1
            sink.flush()
            items = work_items(slices, num_parts, budget)
            to_run = num_rows - skipped - rejected_now
            log.info(
                "cluster: %d rows spilled by %d tasks into %d partitions over %d workers",
                num_rows,
                len(slices),
                len(items),
                job.cluster.workers,
            )
            if progress or heartbeat_s:
                print(
                    f"batchjob: {results_phrase(num_rows, num_rows)}: {to_run} to run in "
                    f"{len(items)} partitions on {job.cluster.workers} workers, {skipped} "
                    f"done earlier, {n_rejected} rejected -> {layout.output}",
                    file=sys.stderr,
                    flush=True,
                )
            t0 = time.perf_counter()
            finished: list[PartitionDone] = []
            splits: list[PartitionDone] = []
            if to_run:
                driver = _PartitionDriver(
                    ray,
                    job,
                    layout,
                    manifest,
                    text_prompts,
                    run_token or uuid.uuid4().hex[:8],
                    ray.put(done),
                    dataset.num_rows,
                    work,
                    "run_partition",
                )
                driver.heartbeat = Heartbeat(len(items), heartbeat_s) if heartbeat_s else None
                finished = driver.run_items(items)
                splits = driver.splits
            wall = time.perf_counter() - t0
            _log_planning(finished + splits)
            stats = _sum_stats([d.stats for d in finished if d.stats is not None])
            _write_plan_pieces(finished, layout.plan_file, stats)
    finally:
        disconnect(ray, started)
    runs = []
    for d in finished:
        if (ex := d.execution) is not None:
            iterations.add(ex.run.iterations)  # to a file: not held per partition
            runs.append(dataclasses.replace(ex, run=dataclasses.replace(ex.run, iterations=[])))
    devices = sorted({e.device for e in runs if e.requests_run})
    device = f"ray:{job.cluster.workers}x{'+'.join(devices) or 'none'}"
    merged = merge(runs, _stats_plan(stats), device, wall)
    stage["plan_s"] = max(plan_seconds(finished + splits).values(), default=0.0)  # slowest
    stage["load_s"] += merged.load_s
    stage["run_s"] = wall
    stage["calibration_s"] = merged.calibration_s  # the largest partition's: workers in parallel
    n_over = merged.over_budget
    t0 = time.perf_counter()
    with owned_workdir(_work_parent(layout), ".commit-buckets-") as buckets:
        streamed = bucket_parts(layout, sink.schema, buckets, num_rows, sink.rows_per_file)
        chunks = streamed.chunks(passthrough, _unify(slices))
        results = sink.commit_chunks(chunks, num_rows)
    stage["write_s"] = time.perf_counter() - t0
    rows = {
        "total": num_rows,
        "ok": num_rows - n_rejected - n_over,
        "rejected": n_rejected + n_over,
        "skipped": skipped,
        "input": num_rows,
    }
    return StreamedRun(merged, results, rows, stage, len(finished), iterations)


def _merge_counts(into, other) -> None:
    values, counts = other.items()
    if len(values):
        into.add(np.repeat(values, counts))


def _merge_totals(into: _Totals, other: _Totals) -> None:
    for f in ("requests", "groups", "logical", "single", "multi"):
        setattr(into, f, getattr(into, f) + getattr(other, f))
    for f in ("sizes", "prefix", "distinct", "decode"):
        _merge_counts(getattr(into, f), getattr(other, f))


def plan_partitioned_on_cluster(
    job: JobConfig,
    plan_path: Target,
    meta: Target,
    tokenizer: PromptTokenizer | None = None,
    dataset: InputDataset | None = None,
    per_worker: dict[str, float] | None = None,
) -> PartitionedPlan:
    """``plan_stream.plan_partitioned`` on the cluster: the workers read, spill and plan the
    partitions, the driver merges their groups into ``plan_path`` in Eq. 4 order.
    ``per_worker``: filled with each worker's planning seconds."""
    if dataset is None:
        dataset = open_input(job.input, job.model, job.sampling)
    budget = budget_of(job.scheduler.plan_memory)
    num_parts = cluster_partitions(dataset, budget, job.cluster.workers)
    layout = OutputLayout.of(job.output)
    ray = _import_ray()
    started = connect(ray, job.cluster)
    try:
        with spill_folder(meta) as work:
            t0 = time.perf_counter()
            slices = spill_on_cluster(ray, job, dataset, work, num_parts, tokenizer)
            read_s, tok_s = _stage_times(slices, time.perf_counter() - t0)
            num_rows = sum(s.rows for s in slices)
            valid = sum(s.valid for s in slices)
            rejected = RejectedSpill(work)
            for rej in _slice_rejected(slices):
                rejected.add(rej)
            tokens = int(sum(int(s.num_tokens.sum()) for s in slices))
            t0 = time.perf_counter()
            driver = _PartitionDriver(
                ray,
                job,
                layout,
                {},
                dataset.prompt_is_text,
                uuid.uuid4().hex[:8],
                None,
                num_rows,
                work,
                "plan_partition",
            )
            finished = driver.run_items(work_items(slices, num_parts, budget))
            totals = _Totals()
            for d in finished:
                _merge_totals(totals, d.totals)
            stats = totals.stats()
            parts = [d.planned for d in finished if d.planned is not None]
            best = _write(parts, stats, plan_path)
            plan_s = time.perf_counter() - t0
    finally:
        disconnect(ray, started)
    _log_planning(finished + driver.splits)
    if per_worker is not None:
        per_worker.update(plan_seconds(finished + driver.splits))
    planned = StreamedPlan(
        stats=stats,
        summary=totals.summary(stats),
        size_counts=dict(zip(*(a.tolist() for a in totals.sizes.items()), strict=True)),
        largest_group=best,
        partitions=len(parts),
        depths=tuple(sorted({FIRST_DEPTH, *(d.depth for d in finished)})),
        largest_partition=max(
            (d.size for d in finished), key=lambda x: plan_bytes(*x), default=(0, 0)
        ),
        over_budget=sum(d.over_budget for d in finished),
    )
    stages = (
        StageTiming("read", read_s, num_rows, 0),
        StageTiming("tokenize", tok_s, num_rows, tokens),
        StageTiming("plan", plan_s, valid, tokens),
    )
    model = model_info_for(job.model, job.engine.backend)
    return PartitionedPlan(planned, rejected, stages, model, budget)


def cannot_partition(job: JobConfig, layout: OutputLayout) -> str | None:
    """Why a cluster job over its planning budget cannot have its workers plan partitions
    (None: it can)."""
    if not isinstance(layout.meta, Path):
        return "the output is on an object store (the workers' spill needs a shared folder)"
    # rows that carry more than their tokens (settings, samples, labels, an adapter)
    columns = ("adapter_column", "n_column", *ROW_SETTING_COLUMNS)
    whole = [f"input.{c}" for c in columns if getattr(job.input, c, None)]
    if job.sampling.n > 1:
        whole.append("sampling.n")
    if job.sampling.labels:
        whole.append("sampling.labels")
    if job.model.adapter:
        whole.append("model.adapter")
    if job.input.path.endswith(".jsonl"):
        whole.append("an OpenAI Batch input")
    if whole:
        return f"{', '.join(whole)} on a cluster"
    return None


def plan_on_cluster(
    job: JobConfig,
    plan_path: Target,
    meta: Target,
    tokenizer: PromptTokenizer | None = None,
    dataset: InputDataset | None = None,
) -> PartitionedPlan:
    """``plan_partitioned_on_cluster`` with ``plan_stream.plan_partitioned``'s signature."""
    return plan_partitioned_on_cluster(job, plan_path, meta, tokenizer, dataset)
