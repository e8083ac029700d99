"""Batched tokenization: Parquet prompt batches -> ``TokenizedPrompts`` (+ rejected rows).

Text columns go through the model's tokenizer (``batchjob.tokenize.tokenizer``: Hugging Face
``tokenizers``, ``encode_batch_fast``, parallel over cores in Rust); token-id columns are
taken straight from the Arrow list offsets and values. Python work is per row at most, never
per token. Rows are checked against the model (``batchjob.model.info``): token ids below its
vocab size, prompt + 1 within its context length.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjob.config import InputConfig, ModelConfig, SamplingConfig
from batchjob.errors import ModelError
from batchjob.inputs.parquet import (
    InputDataset,
    PassthroughCollector,
    PromptBatch,
    RejectedRows,
    timed_batches,
)
from batchjob.inputs.row_settings import with_row_settings
from batchjob.inputs.source import open_input
from batchjob.model.info import ModelInfo, model_info_for
from batchjob.status import (
    STATUS_EMPTY_PROMPT,
    STATUS_INVALID_MAX_TOKENS,
    STATUS_INVALID_TOKENS,
    STATUS_PROMPT_TOO_LONG,
)
from batchjob.timing import StageTiming
from batchjob.tokenize.prompts import PromptsBuilder, TokenizedPrompts
from batchjob.tokenize.tokenizer import PromptTokenizer, load_tokenizer, parallelism_disabled

log = logging.getLogger(__name__)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TokenizedInput:
    """Everything read from the input: valid prompts, rejected rows, pass-through columns."""

    prompts: TokenizedPrompts  # rows with status ok, in row_id order
    rejected: RejectedRows  # rows rejected per-row, in row_id order
    passthrough: pa.Table  # row_id + input columns except the prompt, every row
    read: StageTiming
    tokenize: StageTiming

    @property
    def num_rows(self) -> int:
        return len(self.prompts) + len(self.rejected)


@dataclass(frozen=True)
class _Part:
    row_ids: np.ndarray  # int64 [n]
    tokens: np.ndarray  # int32 [sum lengths]
    lengths: np.ndarray  # int64 [n]
    max_tokens: np.ndarray  # int32 [n]


def _ids_column(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """list<int> -> (values int64 [V], lengths int64 [B], row has a null id bool [B])."""
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    values = arr.flatten()  # respects slicing; skips null rows
    vals = values.cast(pa.int64(), safe=False).fill_null(-1).to_numpy(zero_copy_only=False)
    nulls = values.is_null().to_numpy(zero_copy_only=False)
    return vals.astype(np.int64), lengths.astype(np.int64), _per_row_any(nulls, lengths)


def _per_row_any(flags: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """bool [V] flags over a flat array -> bool [B]: any flag within each row."""
    if not flags.any():  # the usual case: skip the cumulative sums
        return np.zeros(len(lengths), dtype=bool)
    c = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    ends = np.cumsum(lengths)
    return (c[ends] - c[ends - lengths]) > 0


def tokenize_batch(
    batch: PromptBatch,
    tokenizer: PromptTokenizer | None,
    *,
    default_max_tokens: int,
    max_model_len: int | None,
    vocab_size: int | None,
    prompt_column: str = "prompt",
) -> tuple[_Part, RejectedRows]:
    """Tokenize/validate one batch; reject rows per row instead of failing the batch."""
    n = len(batch)
    arr = batch.prompts
    is_text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
    empty = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    bad_ids = np.zeros(n, dtype=bool)
    null_ids = np.zeros(n, dtype=bool)
    huge = np.zeros(n, dtype=bool)  # text too long for the context by its bytes alone
    nbytes = np.zeros(n, dtype=np.int64)
    if is_text:
        if tokenizer is None:
            raise ModelError("a text prompt column needs model.path (for its tokenizer.json)")
        blank = pc.equal(pc.binary_length(pc.utf8_trim_whitespace(arr)), 0)  # "", "  ", "\n"
        empty |= pc.fill_null(blank, True).to_numpy(zero_copy_only=False)
        if max_model_len is not None:  # skip tokenizing what cannot fit (8 MB: 1.4 GB peak)
            nbytes = pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
            huge = ~empty & (nbytes > max_model_len * tokenizer.max_text_bytes_per_token)
        keep_text = np.flatnonzero(~empty & ~huge)
        texts = arr.take(pa.array(keep_text)).to_pylist()
        vals, sub_len = tokenizer.encode(texts, add_special_tokens=batch.add_special_tokens)
        lengths = np.zeros(n, dtype=np.int64)
        lengths[keep_text] = sub_len
    else:
        vals, lengths, null_ids = _ids_column(arr)  # null_ids: a null inside the list
    hi = vocab_size if vocab_size is not None else _INT32_MAX + 1
    bad_ids |= _per_row_any((vals < 0) | (vals >= hi), lengths) & ~null_ids
    empty |= (lengths == 0) & ~huge
    too_long = lengths > max_model_len - 1 if max_model_len is not None else np.zeros(n, dtype=bool)
    if batch.max_tokens is None or batch.max_tokens_null is None:
        mt = np.full(n, default_max_tokens, dtype=np.int64)
    else:
        mt = np.where(batch.max_tokens_null, default_max_tokens, batch.max_tokens)
    bad_mt = (mt <= 0) | (mt > _INT32_MAX)

    # one status per row, first match wins
    checks = [
        (empty, STATUS_EMPTY_PROMPT, "column {c!r} is null, empty or whitespace only"),
        (null_ids, STATUS_INVALID_TOKENS, "column {c!r} has a null token id"),
        (huge, STATUS_PROMPT_TOO_LONG, "prompt of {b} bytes cannot fit {m} tokens (not tokenized)"),
        (bad_ids, STATUS_INVALID_TOKENS, "column {c!r} has token ids outside [0, {v})"),
        (too_long, STATUS_PROMPT_TOO_LONG, "prompt of {n} tokens exceeds max_model_len - 1 = {m}"),
        (bad_mt, STATUS_INVALID_MAX_TOKENS, "max_tokens {t} must be in [1, 2147483647]"),
    ]
    status: list[str | None] = [None] * n
    messages: list[str] = [""] * n
    if batch.rejected is not None:  # rows the prompt builder rejected (their prompt is null)
        for rid, code, msg in zip(
            *(batch.rejected.row_ids, batch.rejected.status, batch.rejected.message), strict=True
        ):
            i = int(rid - batch.row_ids[0])  # a batch's row ids are consecutive
            status[i], messages[i] = code, msg
    for mask, code, fmt in checks:
        for i in np.flatnonzero(mask):
            if status[i] is None:
                status[i] = code
                msg = fmt.format(
                    c=prompt_column,
                    v=vocab_size if vocab_size is not None else _INT32_MAX + 1,
                    n=int(lengths[i]),
                    m=(max_model_len or 0) - 1,
                    t=int(mt[i]),
                    b=int(nbytes[i]),
                )
                messages[i] = f"{batch.where(i)}: {msg}"
    reject = empty | null_ids | bad_ids | huge | too_long | bad_mt
    rej_idx = np.flatnonzero(reject)
    rejected = RejectedRows(
        batch.row_ids[rej_idx],
        tuple(status[i] for i in rej_idx),
        tuple(messages[i] for i in rej_idx),
    )
    keep = ~reject
    token_keep = np.repeat(keep, lengths)
    part = _Part(
        row_ids=batch.row_ids[keep],
        tokens=vals[token_keep].astype(np.int32),
        lengths=lengths[keep],
        max_tokens=mt[keep].astype(np.int32),
    )
    return part, rejected


def _token_capacity(dataset: InputDataset) -> int:
    """Upper bound of a token-id column's tokens: its values in the Parquet metadata of local
    files (0 when unknown: text prompts, a prompt builder, an object store)."""
    if dataset.prompt_is_text or dataset.builder is not None:
        return 0
    total = 0
    try:
        for path in dataset.files:
            if not os.path.isfile(path):
                return 0
            meta = pq.read_metadata(path)
            cols = [
                i
                for i in range(meta.num_columns)
                if meta.schema.column(i).path.split(".")[0] == dataset.prompt_column
            ]
            for rg in range(meta.num_row_groups):
                total += sum(meta.row_group(rg).column(i).num_values for i in cols)
    except (OSError, pa.ArrowException):
        return 0
    return total


def tokenize_dataset(
    dataset: InputDataset,
    tokenizer: PromptTokenizer | None,
    *,
    default_max_tokens: int,
    max_model_len: int | None,
    vocab_size: int | None,
) -> TokenizedInput:
    """Stream every batch: read, tokenize, validate; collect pass-through columns."""
    if dataset.prompt_is_text and tokenizer is None:
        raise ModelError("a text prompt column needs model.path (for its tokenizer.json)")
    if dataset.prompt_is_text and parallelism_disabled():
        log.warning("TOKENIZERS_PARALLELISM disables parallel tokenization (one core)")
    built = PromptsBuilder(dataset.num_rows, _token_capacity(dataset))
    rejected: list[RejectedRows] = []
    passthrough = PassthroughCollector()
    t_read = t_tok = 0.0
    for batch, read_s in timed_batches(dataset):
        t_read += read_s
        t1 = time.perf_counter()
        part, rej = tokenize_batch(
            batch,
            tokenizer,
            default_max_tokens=default_max_tokens,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            prompt_column=dataset.prompt_column,
        )
        passthrough.add(batch)
        built.add(part.row_ids, part.tokens, part.lengths, part.max_tokens)
        rejected.append(rej)
        t_tok += time.perf_counter() - t1

    prompts = built.build()
    # the reader's Arrow buffers are free now; the pool (mimalloc) keeps their pages unless
    # told: 1M short token-id rows, RSS after reading 645 -> 416 MiB, before planning starts
    pa.default_memory_pool().release_unused()
    num_rows = len(prompts) + sum(len(r) for r in rejected)
    total = len(prompts.tokens)
    return TokenizedInput(
        prompts=prompts,
        rejected=RejectedRows.concat(rejected),
        passthrough=passthrough.table(),
        read=StageTiming("read", t_read, num_rows, 0),
        tokenize=StageTiming("tokenize", t_tok, num_rows, total),
    )


def _say_which_max_tokens(
    inp: InputConfig, sampling: SamplingConfig, dataset: InputDataset
) -> None:
    """A job that gave sampling.max_tokens over data with a max_tokens column it did not
    name: the column sets each row's limit (the documented precedence), said in one line."""
    from batchjob.config.load import IMPLICIT_MAX_TOKENS_COLUMN

    column = dataset.max_tokens_column
    if column is None or not getattr(inp, IMPLICIT_MAX_TOKENS_COLUMN, False):
        return
    if str(inp.path).endswith(".jsonl"):
        return  # OpenAI Batch: each request's max_tokens is its own row's, by design
    object.__setattr__(inp, IMPLICIT_MAX_TOKENS_COLUMN, False)  # one line a job (a Generator)
    log.warning(
        "input column %r sets each row's max_tokens (rows where it is null: sampling."
        "max_tokens = %d); set input.max_tokens_column = none to apply %d to every row",
        column,
        sampling.max_tokens,
        sampling.max_tokens,
    )


def load_prompts(
    inp: InputConfig,
    model: ModelConfig,
    sampling: SamplingConfig,
    backend: str,
    tokenizer: PromptTokenizer | None = None,
    dataset: InputDataset | None = None,
) -> tuple[TokenizedInput, ModelInfo | None]:
    """Open the job's input and model folder and tokenize everything (plan and run use it).

    The model folder is read once (``ModelInfo``, None without model.path) and returned for
    the later stages. ``backend``: ``engine.backend`` (it picks the dtype and how per-row
    schemas are checked). ``tokenizer``: the job's, when the caller has loaded it already (run
    needs it to decode outputs too); else it is loaded here if the prompts are text.
    ``dataset``: the input opened already (an in-memory table, ``batchjob.inputs.table``);
    None: ``input.path`` is opened here.
    """
    if dataset is None:
        dataset = open_input(inp, model, sampling)
    _say_which_max_tokens(inp, sampling, dataset)
    info = model_info_for(model, backend)
    if dataset.prompt_is_text and tokenizer is None:
        if model.path is None:
            raise ModelError(
                f"model.path: required because column {dataset.prompt_column!r} is text"
            )
        tokenizer = load_tokenizer(model.tokenizer_path)
    result = tokenize_dataset(
        dataset,
        tokenizer,
        default_max_tokens=sampling.max_tokens,
        max_model_len=info.max_model_len if info else model.max_model_len,
        vocab_size=info.vocab_size if info else None,
    )
    max_len = info.max_model_len if info else model.max_model_len
    vocab = info.vocab_size if info else None
    rows = with_row_settings(inp, sampling, model, backend, result, tokenizer, max_len, vocab)
    return rows, info
