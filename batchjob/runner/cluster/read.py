"""Read and tokenize a cluster job's input as Ray tasks over its Parquet fragments.

A fragment is one row group of one input file, found from the Parquet metadata alone (the
driver reads no row data). Consecutive fragments are grouped into at most
``cluster.workers`` tasks of about equal rows; each task runs the single-process code
(``batchjob.tokenize.batched.tokenize_dataset`` over a ``FragmentDataset``: same reader, prompt
builder, validation and messages) and returns its ``TokenizedInput`` (flat token ids +
offsets, rejected rows, pass-through columns). The driver concatenates them in row-id order
into what ``load_prompts`` gives, then applies the per-row settings to the whole input as
the single-process path does (``with_row_settings``, vectorised over the pass-through).

Inputs that cannot be split (OpenAI JSONL, one row group in all) are read in this process by
``load_prompts`` itself. Ray is imported only when tasks run.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.config import JobConfig
from batchjob.errors import BatchJobError, InputDataError
from batchjob.inputs.parquet import InputDataset, PromptBatch, RejectedRows
from batchjob.inputs.prompt_builder import make_builder
from batchjob.inputs.row_settings import with_row_settings
from batchjob.inputs.source import open_input
from batchjob.model.info import ModelInfo, model_info_for
from batchjob.runner.execute import job_tokenizer
from batchjob.storage.stores import arrow_source
from batchjob.storage.stores import configure as configure_storage
from batchjob.timing import StageTiming
from batchjob.tokenize.batched import TokenizedInput, load_prompts, tokenize_dataset
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fragment:
    """Rows of one row group of one input file."""

    path: str
    row_group: int
    row_start: int  # global row id of its first row
    file_row: int  # index of its first row within the file
    num_rows: int  # after input.limit


def fragments(dataset: InputDataset) -> list[Fragment]:
    """Every row group of the dataset in row-id order, cut at ``input.limit`` (metadata)."""
    out: list[Fragment] = []
    left, base = dataset.num_rows, 0
    for path, nrows in zip(dataset.files, dataset.file_rows, strict=True):
        if left <= 0:
            break
        try:
            src, fs = arrow_source(path)
            meta = pq.read_metadata(src, filesystem=fs)
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise InputDataError(f"{path}: not a readable Parquet file ({e})") from None
        file_row = 0
        for rg in range(meta.num_row_groups):
            n = min(meta.row_group(rg).num_rows, left)
            if n > 0:
                out.append(Fragment(path, rg, base + file_row, file_row, n))
            file_row += meta.row_group(rg).num_rows
            left -= n
            if left <= 0:
                break
        base += nrows
    return out


def group(frags: list[Fragment], tasks: int) -> list[tuple[Fragment, ...]]:
    """Consecutive fragments in at most ``tasks`` groups of about equal rows."""
    if not frags:
        return []
    ends = np.cumsum([f.num_rows for f in frags])
    targets = ends[-1] * np.arange(1, tasks) / tasks
    cuts = sorted({int(np.argmin(np.abs(ends - t))) + 1 for t in targets})  # nearest end
    bounds = [0, *[c for c in cuts if 0 < c < len(frags)], len(frags)]
    return [tuple(frags[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


@dataclass(frozen=True)
class FragmentDataset(InputDataset):
    """The dataset restricted to some fragments: ``batches()`` yields only their rows, with
    their global row ids and file row numbers (for messages)."""

    fragments: tuple[Fragment, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.fragments)

    def batches(self) -> Iterator[PromptBatch]:
        for frag in self.fragments:
            done = 0
            try:
                src, fs = arrow_source(frag.path)
                with pq.ParquetFile(src, filesystem=fs) as f:
                    for rb in f.iter_batches(
                        batch_size=self.batch_rows, row_groups=[frag.row_group]
                    ):
                        if done >= frag.num_rows:
                            break
                        rb = rb.slice(0, frag.num_rows - done)
                        if rb.num_rows == 0:
                            continue
                        start, file_row = frag.row_start + done, frag.file_row + done
                        yield self._to_prompt_batch(rb, frag.path, start, file_row)
                        done += rb.num_rows
            except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
                raise InputDataError(
                    f"{frag.path}: cannot read Parquet data near row {frag.file_row + done}: {e}"
                ) from None


def read_fragments(
    job: JobConfig,
    dataset: InputDataset,
    frags: tuple[Fragment, ...],
    max_model_len: int | None,
    vocab_size: int | None,
    builds_prompts: bool = False,
) -> tuple[int, TokenizedInput]:
    """One Ray task: read, build prompts, tokenize and validate ``frags`` (in a worker
    process) -> (its pid, the rows as ``tokenize_dataset`` gives them). ``builds_prompts``:
    the driver's dataset had a prompt builder (a template or chat input), rebuilt here."""
    configure_storage(job.storage)
    builder = make_builder(job.input, job.model) if builds_prompts else None
    part = FragmentDataset(**{**_fields(dataset), "builder": builder, "fragments": frags})
    tokenizer = job_tokenizer(job.model, job.sampling, True) if dataset.prompt_is_text else None
    loaded = tokenize_dataset(
        part,
        tokenizer,
        default_max_tokens=job.sampling.max_tokens,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )
    return os.getpid(), loaded


def _fields(dataset: InputDataset) -> dict:
    return {f.name: getattr(dataset, f.name) for f in dataclasses.fields(InputDataset)}


def concat(parts: list[TokenizedInput], seconds: float) -> TokenizedInput:
    """Parts in row-id order -> one ``TokenizedInput``, as one process would have read it.
    Stage times: the parallel stage's wall time, split in the tasks' read/tokenize ratio."""
    prompts = [p.prompts for p in parts]
    lengths = np.concatenate([p.lengths for p in prompts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    merged = TokenizedPrompts(
        row_ids=np.concatenate([p.row_ids for p in prompts]).astype(np.int64),
        tokens=np.concatenate([p.tokens for p in prompts]).astype(np.int32),
        offsets=offsets,
        max_tokens=np.concatenate([p.max_tokens for p in prompts]).astype(np.int32),
    )
    passthrough = pa.concat_tables(
        [p.passthrough for p in parts], promote_options="permissive"
    ).combine_chunks()
    rejected = RejectedRows.concat([p.rejected for p in parts])
    read = sum(p.read.seconds for p in parts)
    tok = sum(p.tokenize.seconds for p in parts)
    share = read / (read + tok) if read + tok > 0 else 0.0
    rows = len(merged) + len(rejected)
    return TokenizedInput(
        prompts=merged,
        rejected=rejected,
        passthrough=passthrough,
        read=StageTiming("read", seconds * share, rows, 0),
        tokenize=StageTiming("tokenize", seconds * (1 - share), rows, len(merged.tokens)),
    )


def load_prompts_on_cluster(
    job: JobConfig, tokenizer: PromptTokenizer | None = None
) -> tuple[TokenizedInput, ModelInfo | None]:
    """``load_prompts`` with the reading and tokenizing done by Ray tasks over fragments."""
    from batchjob.runner.cluster.driver import _import_ray, connect, disconnect, runtime_options

    dataset = open_input(job.input, job.model)
    tasks = (
        [] if job.input.path.endswith(".jsonl") else group(fragments(dataset), job.cluster.workers)
    )
    if len(tasks) < 2:  # nothing to split: one process reads it
        log.info("read + tokenize in this process (%d fragment groups)", len(tasks))
        return load_prompts(job.input, job.model, job.sampling, job.engine.backend, tokenizer)
    info = model_info_for(job.model, job.engine.backend)
    max_len = info.max_model_len if info else job.model.max_model_len
    vocab = info.vocab_size if info else None
    ray = _import_ray()
    started = connect(ray, job.cluster)
    t0 = time.perf_counter()
    try:
        task = ray.remote(read_fragments).options(**runtime_options())
        meta = _fields(dataset) | {"builder": None}  # each task rebuilds its prompt builder
        bare = InputDataset(**meta)
        builds = dataset.builder is not None
        refs = [task.remote(job, bare, frags, max_len, vocab, builds) for frags in tasks]
        try:
            done = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, BatchJobError):
                raise cause from None  # a corrupt file, a bad column: its own exit code
            raise
    finally:
        disconnect(ray, started)
    loaded = concat([p for _, p in done], time.perf_counter() - t0)
    log.info(
        "read + tokenize: %d rows, %d fragments in %d Ray tasks (%d processes), %.2f s",
        loaded.num_rows,
        sum(map(len, tasks)),
        len(tasks),
        len({pid for pid, _ in done}),
        loaded.read.seconds + loaded.tokenize.seconds,
    )
    pa.default_memory_pool().release_unused()
    if dataset.prompt_is_text and tokenizer is None:
        tokenizer = job_tokenizer(job.model, job.sampling, True)
    backend = job.engine.backend
    rows = with_row_settings(
        job.input, job.sampling, job.model, backend, loaded, tokenizer, max_len, vocab
    )
    return rows, info
