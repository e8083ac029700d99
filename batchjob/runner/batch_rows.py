"""``prepare``'s row work on one batch at a time, for the partitioned paths (``plan_stream``).

``prepare`` reads, tokenizes and checks the whole input, then reads the per-row settings,
the scoring labels and the LoRA adapter of every row from the whole pass-through table.
Every one of those checks and values is the row's own (a label is tokenized the same in any
batch), so ``BatchRows`` does the same to each batch as it is read: tokenize
(``tokenize_batch``), the per-row settings and labels (``with_row_settings``: bad values
rejected with their status, scoring's KV need as max_tokens), the embedding task's
max_tokens, the adapters (``assign_adapters``), max_tokens capped to the context. What it
returns is ready to spill: the valid rows with their settings and adapter indices
(``partition.Rows``), the rejected rows, and each input row's number of results (its samples,
``sampling.n`` or its ``n_column`` value; one for a rejected row).

``position`` (``partition.ROW``) counts requests on across batches: the position in the
in-memory run's request order of each row's first sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchjob.config import JobConfig
from batchjob.inputs.parquet import PromptBatch, RejectedRows
from batchjob.inputs.row_settings import settings_of_rows, with_row_settings
from batchjob.plan.partition import ROW, Rows
from batchjob.runner.execute import job_samples
from batchjob.timing import StageTiming
from batchjob.tokenize.adapters import assign_adapters
from batchjob.tokenize.batched import TokenizedInput, tokenize_batch
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.samples import sample_counts
from batchjob.tokenize.tokenizer import PromptTokenizer, load_tokenizer


@dataclass(frozen=True)
class PreparedBatch:
    """One batch's rows as ``BatchRows`` leaves them."""

    rows: Rows  # the valid rows, settings and adapters attached
    rejected: RejectedRows
    results: np.ndarray  # int64 [len(batch)]: result rows of each input row, in row order
    requests: int  # the valid rows' requests (samples)


def needs_rows_pass(job: JobConfig) -> bool:
    """Whether the job's rows carry anything past their tokens: per-row settings, labels,
    adapters or samples."""
    from batchjob.config.per_row import ROW_SETTING_COLUMNS

    inp, sampling = job.input, job.sampling
    return (
        any(getattr(inp, c, None) for c in ROW_SETTING_COLUMNS)
        or bool(sampling.labels)
        or bool(job.model.adapters)
        or sampling.n > 1
    )


class BatchRows:
    """``prepare``'s per-row work, batch by batch (the module doc)."""

    def __init__(
        self,
        job: JobConfig,
        tokenizer: PromptTokenizer | None,
        max_model_len: int | None,
        vocab_size: int | None,
        prompt_column: str,
    ):
        self.job = job
        inp, sampling = job.input, job.sampling
        if (inp.stop_column or sampling.labels or inp.labels_column) and tokenizer is None:
            tokenizer = load_tokenizer(job.model.tokenizer_path)  # once, not per batch
        self.tokenizer = tokenizer
        self.max_len = max_model_len
        self.vocab = vocab_size
        self.prompt_column = prompt_column
        self.samples = job_samples(sampling, inp)
        self.extras = needs_rows_pass(job)
        self.position = 0  # the next row's first request position
        self._nothing = StageTiming("read", 0.0, 0, 0)

    def __call__(self, batch: PromptBatch) -> PreparedBatch:
        job = self.job
        part, rej = tokenize_batch(
            batch,
            self.tokenizer,
            default_max_tokens=job.sampling.max_tokens,
            max_model_len=self.max_len,
            vocab_size=self.vocab,
            prompt_column=self.prompt_column,
        )
        offsets = np.zeros(len(part.row_ids) + 1, dtype=np.int64)
        np.cumsum(part.lengths, out=offsets[1:])
        prompts = TokenizedPrompts(part.row_ids, part.tokens, offsets, part.max_tokens)
        if self.extras:
            loaded = TokenizedInput(prompts, rej, batch.passthrough, self._nothing, self._nothing)
            loaded = with_row_settings(
                job.input,
                job.sampling,
                job.model,
                job.engine.backend,
                loaded,
                self.tokenizer,
                self.max_len,
                self.vocab,
            )
            names = tuple(job.model.adapters)
            loaded = assign_adapters(loaded, names, job.input.adapter_column, job.model.adapter)
            prompts, rej = loaded.prompts, loaded.rejected
        mt = prompts.max_tokens.astype(np.int64)
        if job.model.task == "embed":  # as prepare has it: KV for the prompt alone
            mt = np.ones_like(mt)
        if self.max_len is not None:  # as Prepared.requests caps them (cap_to_context)
            mt = np.minimum(mt, np.maximum(self.max_len - prompts.lengths, 1))
        n = len(prompts)
        counts = (
            np.ones(n, dtype=np.int64)
            if self.samples == (1, False)
            else sample_counts(prompts, self.samples[0])
        )
        rows = np.zeros(n, dtype=ROW)
        rows["position"] = self.position + np.cumsum(counts) - counts
        rows["row_id"] = prompts.row_ids
        rows["length"] = prompts.lengths
        rows["max_tokens"] = mt
        requests = int(counts.sum())
        self.position += requests
        settings = prompts.settings  # keyed by row id: may hold rows rejected since
        if settings is not None:
            settings = settings_of_rows(settings, prompts.row_ids)
        results = np.ones(len(batch), dtype=np.int64)
        if len(batch):
            results[prompts.row_ids - int(batch.row_ids[0])] = counts  # consecutive ids
        spilled = Rows(rows, prompts.tokens.astype(np.int32, copy=False), settings, prompts.adapter)
        return PreparedBatch(spilled, rej, results, requests)


def passthrough_schema(schema: pa.Schema | None, batch: PromptBatch) -> pa.Schema:
    """The pass-through columns' schema over the batches so far, ``batch``'s unified in."""
    pt = batch.passthrough.schema
    return pt if schema is None else pa.unify_schemas([schema, pt], promote_options="permissive")
