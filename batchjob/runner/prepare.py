"""The prepare stage of every job: read -> tokenize -> reject bad rows -> expand samples.

``prepare(job)`` reads and tokenizes the job's input (one machine, or Ray tasks over its row
groups) with the per-row settings, the rows that cannot run rejected with a status; its
``Prepared.requests()`` are the requests the job runs: every row's ``sampling.n`` samples,
max_tokens capped to the model's context, less those an earlier run wrote. ``batchjob run``
(``pipeline``), ``batchjob plan`` and ``batchjob.generate`` all start here, so the plan that
``batchjob plan`` reports is the plan ``batchjob run`` executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from batchjob.config import JobConfig
from batchjob.inputs.parquet import InputDataset
from batchjob.model.info import ModelInfo
from batchjob.model.pooling import pooling_spec
from batchjob.outputs.results import ResultRow, RowSink
from batchjob.runner.execute import cap_to_context, expected_results, job_samples, select_rows
from batchjob.tokenize.adapters import assign_adapters
from batchjob.tokenize.batched import TokenizedInput, load_prompts
from batchjob.tokenize.prompts import TokenizedPrompts, request_keys
from batchjob.tokenize.samples import expand_samples
from batchjob.tokenize.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class Prepared:
    """A job's input read and tokenized, and how its rows become requests."""

    loaded: TokenizedInput  # valid prompts (one per row), rejected rows, pass-through columns
    model: ModelInfo | None  # the model folder, read once (None without model.path)
    samples: tuple[int, bool]  # sampling.n, whether rows set their own (``job_samples``)

    @property
    def expected(self) -> int:
        """Result rows the job has: one per sample of every valid row, one per rejected row."""
        return expected_results(self.loaded, self.samples)

    def requests(self, done: np.ndarray | None = None) -> TokenizedPrompts:
        """The requests to run: every row's samples, less the ones in ``done`` (result keys
        an earlier run wrote, ``request_keys``), max_tokens capped to the model's context."""
        prompts = expand_samples(self.loaded.prompts, *self.samples)
        if done is not None and len(done):
            prompts = select_rows(prompts, ~np.isin(prompts.keys, done))
        if self.model is not None:
            prompts = cap_to_context(prompts, self.model.max_model_len)
        return prompts

    def report_rejected(self, sink: RowSink, done: np.ndarray | None = None) -> None:
        """Every rejected row not in ``done`` to ``sink``, as its one result row."""
        rejected = self.loaded.rejected
        todo = np.ones(len(rejected), dtype=bool)
        if done is not None:
            todo = ~np.isin(request_keys(rejected.row_ids), done)
        for i in np.flatnonzero(todo):
            rid = int(rejected.row_ids[i])
            row = ResultRow(rid, None, None, 0, 0, None, rejected.status[i], rejected.message[i])
            sink.add(row)


def prepare(
    job: JobConfig,
    tokenizer: PromptTokenizer | None = None,
    *,
    dataset: InputDataset | None = None,
    on_cluster: bool = False,
) -> Prepared:
    """Read, tokenize and check every row of ``job``'s input.

    ``tokenizer``: the job's, when the caller loaded it already (run decodes outputs with
    it); None: loaded here if the prompts are text. ``dataset``: the input opened already (an
    in-memory table, ``batchjob.inputs.table``); None: ``input.path``. ``on_cluster``: read
    and tokenize as Ray tasks over the input's row groups (``batchjob.runner.cluster.read``).
    """
    if on_cluster:
        from batchjob.runner.cluster import load_prompts_on_cluster

        loaded, model = load_prompts_on_cluster(job, tokenizer)
    else:
        loaded, model = load_prompts(
            job.input, job.model, job.sampling, job.engine.backend, tokenizer, dataset=dataset
        )
    if (
        job.model.task == "embed"
    ):  # KV for the prompt alone; pooling settings checked before any model runs
        ones = np.ones(len(loaded.prompts), dtype=np.int32)
        loaded = dataclasses.replace(
            loaded, prompts=dataclasses.replace(loaded.prompts, max_tokens=ones)
        )
        if model is not None:
            pooling_spec(job.model, model.path, model.config.hidden_size)
    names = tuple(job.model.adapters)  # each row's LoRA adapter (model.adapters)
    loaded = assign_adapters(loaded, names, job.input.adapter_column, job.model.adapter)
    return Prepared(loaded, model, job_samples(job.sampling, job.input))
