"""`batchjob plan` of a dataset larger than its planning budget, in one streaming pass.

``partitioned_reason(job, dataset)`` says whether a job plans in partitions: its estimated
in-memory planning peak (``batchjob.plan.budget.plan_bytes`` of its rows and tokens, from
the input's metadata) exceeds ``scheduler.plan_memory``, and nothing in it needs the whole
dataset at once (per-row setting columns, ``sampling.n`` above 1 and scoring labels plan
in memory, as before, and so do per-row adapters). A job within its budget plans in
memory exactly as it always has.

``plan_partitioned`` reads and tokenizes the input batch by batch (the same checks as
``batchjob.tokenize.batched``: each bad row rejected with its status), spills each valid
row's token ids to a partition by its first tokens under the metadata folder, and plans the
partitions into the plan file (``batchjob.plan.streamed``). It holds one batch, the
rejected rows and then one partition at a time: not the dataset.
"""

from __future__ import annotations

import logging
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import JobConfig
from batchjob.config.per_row import ROW_SETTING_COLUMNS
from batchjob.errors import ModelError
from batchjob.inputs.parquet import InputDataset, RejectedRows
from batchjob.inputs.row_token_ids import check_token_ids
from batchjob.inputs.source import open_input
from batchjob.model.info import ModelInfo, model_info_for
from batchjob.plan.budget import budget_of, num_partitions, plan_bytes
from batchjob.plan.partition import ROW, PartitionSpill, Rows
from batchjob.plan.streamed import StreamedPlan, plan_spilled
from batchjob.storage.atomic import Target
from batchjob.timing import StageTiming
from batchjob.tokenize.batched import tokenize_batch
from batchjob.tokenize.tokenizer import PromptTokenizer, load_tokenizer

log = logging.getLogger(__name__)
TEXT_BYTES_PER_TOKEN = 4  # text prompts: the token estimate before tokenizing


@dataclass(frozen=True)
class PartitionedPlan:
    """What ``plan_partitioned`` read and planned."""

    planned: StreamedPlan
    rejected: RejectedRows
    stages: tuple[StageTiming, ...]  # read, tokenize (+ spill), plan (+ write)
    model: ModelInfo | None
    budget: int


def estimated_tokens(dataset: InputDataset) -> int:
    """The input's prompt tokens, from its Parquet metadata: a token-id column's values, a
    text column's uncompressed bytes / 4; a file's size / 4 where there is no metadata."""
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
            if meta.schema.column(i).path.split(".")[0] == dataset.prompt_column
        ]
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            for i in cols:
                col = group.column(i)
                if dataset.prompt_is_text:
                    total += col.total_uncompressed_size // TEXT_BYTES_PER_TOKEN
                else:
                    total += col.num_values
    return total


def partitioned_reason(job: JobConfig, dataset: InputDataset) -> str | None:
    """Why ``job`` plans in partitions (a log line), or None: it plans in memory."""
    need = plan_bytes(dataset.num_rows, estimated_tokens(dataset))
    budget = budget_of(job.scheduler.plan_memory)
    if need <= budget:
        return None
    # input.adapter_column: groups keyed by (adapter, tokens), which the partitions ignore
    columns = (*ROW_SETTING_COLUMNS, "adapter_column")
    whole = [f"input.{c}" for c in columns if getattr(job.input, c, None)]
    if job.sampling.n > 1:
        whole.append("sampling.n")
    if job.sampling.labels:
        whole.append("sampling.labels")
    if whole:
        log.warning(
            "planning in memory (~%d MiB, over scheduler.plan_memory = %d MiB): %s need "
            "the whole dataset at once",
            need >> 20,
            budget >> 20,
            ", ".join(whole),
        )
        return None
    return (
        f"planning in partitions: ~{need >> 20} MiB in memory exceeds "
        f"scheduler.plan_memory = {budget >> 20} MiB"
    )


def _spill_folder(plan_path: Target, meta: Target) -> Path:
    """Where the partitions go: the metadata folder when local, else a temp folder."""
    if isinstance(meta, Path):
        meta.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".plan-spill-", dir=meta))
    return Path(tempfile.mkdtemp(prefix="batchjob-plan-spill-"))


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
    tokens_est = estimated_tokens(dataset)
    spill = PartitionSpill(
        _spill_folder(plan_path, meta), num_partitions(dataset.num_rows, tokens_est, budget)
    )
    rejected: list[RejectedRows] = []
    t_read = t_tok = 0.0
    position = 0
    total_tokens = 0
    batches = dataset.batches()
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        t1 = time.perf_counter()
        t_read += t1 - t0
        if batch is None:
            break
        part, rej = tokenize_batch(
            batch,
            tokenizer,
            default_max_tokens=job.sampling.max_tokens,
            max_model_len=max_len,
            vocab_size=vocab,
            prompt_column=dataset.prompt_column,
        )
        rows = np.zeros(len(part.row_ids), dtype=ROW)
        rows["position"] = np.arange(position, position + len(rows))
        rows["row_id"] = part.row_ids
        rows["length"] = part.lengths
        mt = part.max_tokens.astype(np.int64)
        if job.model.task == "embed":  # as prepare has it: KV for the prompt alone
            mt = np.ones_like(mt)
        if max_len is not None:  # as Prepared.requests caps them (cap_to_context)
            mt = np.minimum(mt, np.maximum(max_len - part.lengths, 1))
        rows["max_tokens"] = mt
        spill.add(Rows(rows, part.tokens))
        position += len(rows)
        total_tokens += len(part.tokens)
        if len(rej):
            rejected.append(rej)
        t_tok += time.perf_counter() - t1
    pa.default_memory_pool().release_unused()
    num_rows = position + sum(len(r) for r in rejected)
    log.info("stage tokenize done: %d rows, %d tokens", num_rows, total_tokens)
    t0 = time.perf_counter()
    planned = plan_spilled(
        spill,
        budget,
        plan_path,
        job.scheduler,
        on_partition=lambda n, t: log.debug("planning a partition of %d rows, %d tokens", n, t),
    )
    plan_s = time.perf_counter() - t0
    stages = (
        StageTiming("read", t_read, num_rows, 0),
        StageTiming("tokenize", t_tok, num_rows, total_tokens),
        StageTiming("plan", plan_s, position, total_tokens),
    )
    return PartitionedPlan(planned, RejectedRows.concat(rejected), stages, info, budget)
