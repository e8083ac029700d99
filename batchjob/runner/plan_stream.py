"""`batchjob plan` and `batchjob run` of a dataset larger than its planning budget.

``partitioned_reason(job, dataset)`` says whether a job plans in partitions: its estimated
in-memory planning peak (``batchjob.plan.budget.plan_bytes`` of its rows and tokens, from
the input's metadata) exceeds ``scheduler.plan_memory``. A job within its budget plans in
memory exactly as it always has.

``spill_input`` reads and tokenizes the input batch by batch with ``prepare``'s per-row work
(``batch_rows``: the same checks, each bad row rejected with its status; the per-row
settings, scoring labels and LoRA adapters read and checked) and spills each valid row's
token ids, with its settings and adapter, to a partition by its (adapter, first tokens)
under the metadata folder (``spill_folder``); a job of samples (``sampling.n``,
``input.n_column``) also writes each row's first result index there (``ResultStarts``), and
each partition's rows are expanded into their samples when it is planned.
``plan_partitioned`` then plans the partitions into the plan file
(``batchjob.plan.streamed``), ``batchjob.runner.run_stream`` runs them one by one. Either
holds one batch and then one partition at a time (the rejected rows go to the spill folder
in batches as they come): not the dataset.
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import JobConfig
from batchjob.errors import ModelError
from batchjob.inputs.parquet import ROW_ID, InputDataset, timed_batches
from batchjob.inputs.row_token_ids import check_token_ids
from batchjob.inputs.source import open_input
from batchjob.model.info import ModelInfo, model_info_for
from batchjob.outputs.spilled_records import RejectedSpill
from batchjob.outputs.streamed_commit import PassthroughSpill, ResultIndex, ResultStarts
from batchjob.plan.budget import budget_of, num_partitions, plan_bytes
from batchjob.plan.partition import PartitionSpill
from batchjob.plan.streamed import StreamedPlan, plan_spilled
from batchjob.runner.batch_rows import BatchRows, passthrough_schema
from batchjob.storage.atomic import Target
from batchjob.storage.workdir import owned_workdir
from batchjob.timing import StageTiming
from batchjob.tokenize.tokenizer import PromptTokenizer, load_tokenizer

log = logging.getLogger(__name__)
PASSTHROUGH_FILE = "passthrough.arrows"  # in the spill folder: the pass-through columns
TEXT_BYTES_PER_TOKEN = 4  # text prompts: the token estimate before tokenizing
CHAT_BYTES_PER_ROW = 64  # a chat template's markup (role tags, turn ends) per conversation
SPILL_PREFIX = ".plan-spill-"  # <meta>/.plan-spill-*: partitions being planned or run


@dataclass(frozen=True)
class PartitionedPlan:
    """What ``plan_partitioned`` read and planned."""

    planned: StreamedPlan
    rejected: RejectedSpill  # its counts (the file went with the spill folder)
    stages: tuple[StageTiming, ...]  # read, tokenize (+ spill), plan (+ write)
    model: ModelInfo | None
    budget: int


def _prompt_sources(dataset: InputDataset) -> tuple[tuple[str, ...], int]:
    """(the input columns a row's prompt is built from, the bytes every row's prompt adds):
    the prompt column; a template's columns and its literal text; chat messages, or a
    prompt as a chat's user turn, with the system prompt and ``CHAT_BYTES_PER_ROW`` of
    markup (role tags)."""
    b = dataset.builder
    if b is None:
        return (dataset.prompt_column,), 0
    if b.template is not None:
        literal = sum(len(text.encode()) for text, _ in b.template.parts)
        return b.template.columns, literal
    fixed = len(b.system_text.encode()) if b.system_text else 0
    if b.messages_col is not None or b.wrap_prompts:
        fixed += CHAT_BYTES_PER_ROW
    return (b.messages_col or b.prompt_column,), fixed


def _text_bytes(col) -> int:
    """A text column chunk's bytes: its uncompressed size, or where a dictionary holds
    repeated values (one document asked many questions) its values times the mean length
    of their min and max, the larger."""
    size = int(col.total_uncompressed_size)
    stats = col.statistics if col.is_stats_set else None
    if col.has_dictionary_page and stats is not None and stats.has_min_max:
        lo, hi = stats.min, stats.max
        if isinstance(lo, str | bytes) and isinstance(hi, str | bytes):
            mean = (
                len(lo.encode() if isinstance(lo, str) else lo)
                + len(hi.encode() if isinstance(hi, str) else hi)
            ) / 2
            size = max(size, int(col.num_values * mean))
    return size


def estimated_tokens(dataset: InputDataset) -> int:
    """The input's prompt tokens, from its Parquet metadata: a token-id column's values, the
    uncompressed bytes / 4 of the text a prompt is built from (``_prompt_sources``: a
    text prompt column, a template's columns, chat messages, plus each row's fixed text); a
    file's size / 4 where there is no metadata."""
    sources, fixed = _prompt_sources(dataset)
    text = dataset.prompt_is_text or dataset.builder is not None
    total = 0
    for path in dataset.files:
        try:
            meta = pq.read_metadata(path)
        except (OSError, pa.ArrowException, TypeError):
            with suppress(OSError):
                total += Path(path).stat().st_size // TEXT_BYTES_PER_TOKEN
            continue
        cols = [
            i
            for i in range(meta.num_columns)
            if meta.schema.column(i).path.split(".")[0] in sources
        ]
        total += meta.num_rows * fixed // TEXT_BYTES_PER_TOKEN
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            for i in cols:
                col = group.column(i)
                if text:
                    total += _text_bytes(col) // TEXT_BYTES_PER_TOKEN
                else:
                    total += col.num_values
    return total


def partitioned_reason(job: JobConfig, dataset: InputDataset) -> str | None:
    """Why ``job`` plans in partitions (a log line), or None: it plans in memory."""
    need = plan_bytes(dataset.num_rows, estimated_tokens(dataset))
    budget = budget_of(job.scheduler.plan_memory)
    if need <= budget:
        return None
    return (
        f"planning in partitions: ~{need >> 20} MiB in memory exceeds "
        f"scheduler.plan_memory = {budget >> 20} MiB"
    )


def _unify(a: pa.Schema, b: pa.Schema) -> pa.Schema:
    return pa.unify_schemas([a, b], promote_options="permissive")


def spill_folder(meta: Target) -> AbstractContextManager[Path]:
    """The partitions' work folder, this process's until the block ends: under the metadata
    folder when local (``<meta>/.plan-spill-*``; one a killed run left is removed at the next
    start), else under the temp folder."""
    if isinstance(meta, Path):
        return owned_workdir(meta, SPILL_PREFIX)
    return owned_workdir(Path(tempfile.gettempdir()), "batchjob-plan-spill-")


@dataclass(frozen=True)
class SpilledInput:
    """The input read, tokenized and spilled to partitions (``spill_input``)."""

    spill: PartitionSpill
    rejected: RejectedSpill  # under the spill folder, read back in chunks
    num_rows: int  # input rows, valid and rejected
    tokens: int  # the valid rows' prompt tokens
    read_s: float
    tokenize_s: float  # tokenize + spill
    model: ModelInfo | None
    budget: int  # scheduler.plan_memory, resolved
    passthrough: pa.Schema  # the pass-through columns, unified over the batches
    index: ResultIndex | None = None  # where each (row, sample) result lands
    samples: tuple[int, bool] = (1, False)  # sampling.n, whether rows set their own
    passthrough_spill: PassthroughSpill | None = None  # the batches' pass-through columns

    @property
    def num_results(self) -> int:
        return self.num_rows if self.index is None else self.index.num_results


def spill_input(
    job: JobConfig,
    dataset: InputDataset,
    folder: Path,
    tokenizer: PromptTokenizer | None = None,
    num_parts: int | None = None,
    keep_passthrough: bool = False,
) -> SpilledInput:
    """Read and tokenize ``job``'s input batch by batch, each valid row's token ids spilled
    under ``folder`` to a partition by its first tokens; it holds one batch and the rejected
    rows, not the dataset. ``num_parts``: the partition count (default: from the input's size
    and the budget; a slice of the input spilled apart gives the whole input's);
    ``keep_passthrough``: the batches' pass-through columns also copied under ``folder``
    (``PassthroughSpill``), for the commit."""
    info = model_info_for(job.model, job.engine.backend)
    if dataset.prompt_is_text and tokenizer is None:
        if job.model.path is None:
            raise ModelError(
                f"model.path: required because column {dataset.prompt_column!r} is text"
            )
        tokenizer = load_tokenizer(job.model.tokenizer_path)
    max_len = info.max_model_len if info else job.model.max_model_len
    vocab = info.vocab_size if info else None
    check_token_ids(job.sampling, vocab)
    budget = budget_of(job.scheduler.plan_memory)
    if num_parts is None:  # a partition's rows are expanded into their samples when planned
        n = max(job.sampling.n, 1)
        num_parts = num_partitions(dataset.num_rows * n, estimated_tokens(dataset) * n, budget)
    spill = PartitionSpill(folder, num_parts)
    rejected = RejectedSpill(folder)
    rows_of = BatchRows(job, tokenizer, max_len, vocab, dataset.prompt_column)
    kept = PassthroughSpill(folder / PASSTHROUGH_FILE) if keep_passthrough else None
    starts = None if rows_of.samples == (1, False) else ResultStarts(folder / "results.starts")
    schema: pa.Schema | None = None
    t_read = t_tok = 0.0
    valid = 0
    total_tokens = 0
    for batch, read_s in timed_batches(dataset):
        t_read += read_s
        t1 = time.perf_counter()
        schema = passthrough_schema(schema, batch)
        if kept is not None:
            kept.add(batch.passthrough)
        got = rows_of(batch)
        spill.add(got.rows)
        if starts is not None:
            starts.add(got.results)
        valid += len(got.rows.rows)
        total_tokens += len(got.rows.tokens)
        rejected.add(got.rejected)
        t_tok += time.perf_counter() - t1
    pa.default_memory_pool().release_unused()
    num_rows = valid + len(rejected)
    log.info("stage tokenize done: %d rows, %d tokens", num_rows, total_tokens)
    if schema is None:
        schema = pa.schema([(ROW_ID, pa.int64())])
    index = ResultIndex(num_rows) if starts is None else starts.index()
    return SpilledInput(
        spill,
        rejected,
        num_rows,
        total_tokens,
        t_read,
        t_tok,
        info,
        budget,
        schema,
        index=index,
        samples=rows_of.samples,
        passthrough_spill=kept,
    )


def plan_partitioned(
    job: JobConfig,
    plan_path: Target,
    meta: Target,
    tokenizer: PromptTokenizer | None = None,
    dataset: InputDataset | None = None,
) -> PartitionedPlan:
    """Read, tokenize and spill ``job``'s input in one pass; plan it into ``plan_path``.
    ``meta``: the output's metadata folder (the spilled partitions go under it while
    planning); ``dataset``: the input opened already."""
    if dataset is None:
        dataset = open_input(job.input, job.model, job.sampling)
    with spill_folder(meta) as folder:
        s = spill_input(job, dataset, folder, tokenizer)
        t0 = time.perf_counter()
        planned = plan_spilled(
            s.spill,
            s.budget,
            plan_path,
            job.scheduler,
            on_partition=lambda n, t: log.debug("planning a partition of %d rows, %d tokens", n, t),
            samples=s.samples,
            adapters=bool(job.model.adapters),
        )
        plan_s = time.perf_counter() - t0
    valid = s.num_rows - len(s.rejected)
    stages = (
        StageTiming("read", s.read_s, s.num_rows, 0),
        StageTiming("tokenize", s.tokenize_s, s.num_rows, s.tokens),
        StageTiming("plan", plan_s, valid, s.tokens),
    )
    return PartitionedPlan(planned, s.rejected, stages, s.model, s.budget)
