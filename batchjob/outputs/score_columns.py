"""The optional result columns: ``sample_index`` (``sampling.n``), ``reasoning_text``
(``output.reasoning_parser``), ``output_logprobs``
(``sampling.logprobs``), ``prompt_logprobs`` (``sampling.prompt_logprobs``),
``label_logprobs`` and ``label`` (scoring mode), ``embedding`` (``model.task = "embed"``),
built as Arrow arrays without a Python
object per token. ``batchjob.outputs.results`` adds the ones a job asks for to its schema."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from batchjob.backends.base import TokenLogprobs
from batchjob.config import InputConfig, ModelConfig, OutputConfig, SamplingConfig

_TOP = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
_STEP = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()), ("top", pa.list_(_TOP))])
SAMPLE_INDEX = "sample_index"
REASONING_TEXT = "reasoning_text"
OPTIONAL_COLUMNS: dict[str, pa.DataType] = {
    SAMPLE_INDEX: pa.int32(),
    REASONING_TEXT: pa.string(),
    "output_logprobs": pa.list_(_STEP),
    "prompt_logprobs": pa.list_(_STEP),
    "label_logprobs": pa.list_(pa.float32()),
    "label": pa.string(),
    "embedding": pa.list_(pa.float32()),
}


def job_columns(
    sampling: SamplingConfig,
    inp: InputConfig,
    reasoning_parser: str | None = OutputConfig.reasoning_parser,
    task: str = ModelConfig.task,
) -> tuple[str, ...]:
    """The optional columns a job with these settings writes (``reasoning_parser``:
    ``output.reasoning_parser``; ``task``: ``model.task``)."""
    cols: list[str] = ["embedding"] if task == "embed" else []
    if sampling.n > 1 or inp.n_column:
        cols.append(SAMPLE_INDEX)
    if reasoning_parser is not None:
        cols.append(REASONING_TEXT)
    if sampling.logprobs is not None:
        cols.append("output_logprobs")
    if sampling.prompt_logprobs is not None:
        cols.append("prompt_logprobs")
    if sampling.labels or inp.labels_column:
        cols += ["label_logprobs", "label"]
    return tuple(cols)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _mask(valid: np.ndarray) -> pa.Array | None:
    return None if valid.all() else pa.array(~valid)


def logprobs_array(
    token_ids: Sequence[np.ndarray | None],
    logprobs: Sequence[TokenLogprobs | None],
    first_null: bool = False,
) -> pa.Array:
    """One ``output_logprobs`` value per row (null where the row has none); ``first_null``
    (``prompt_logprobs``): each list's first entry is null (the first prompt token has no
    log-prob, as in vLLM)."""
    valid = np.array([lp is not None for lp in logprobs], dtype=bool)
    rows = [(t, lp) for t, lp in zip(token_ids, logprobs, strict=True) if lp is not None]
    lengths = np.array([len(lp.logprob) for lp in logprobs if lp is not None], dtype=np.int64)
    all_lengths = np.zeros(len(logprobs), dtype=np.int64)
    all_lengths[valid] = lengths
    if rows:
        ids = np.concatenate([np.asarray(t, dtype=np.int32)[: len(lp.logprob)] for t, lp in rows])
        lp = np.concatenate([r[1].logprob for r in rows]).astype(np.float32)
        n = rows[0][1].top_ids.shape[1]
        top_ids = np.concatenate([r[1].top_ids.reshape(-1) for r in rows]).astype(np.int32)
        top_lp = np.concatenate([r[1].top_logprobs.reshape(-1) for r in rows]).astype(np.float32)
    else:
        ids, lp, n = np.zeros(0, np.int32), np.zeros(0, np.float32), 0
        top_ids, top_lp = np.zeros(0, np.int32), np.zeros(0, np.float32)
    top = pa.StructArray.from_arrays(
        [pa.array(top_ids, pa.int32()), pa.array(top_lp, pa.float32())], fields=list(_TOP)
    )
    top_lists = pa.ListArray.from_arrays(pa.array(np.arange(len(ids) + 1) * n, pa.int32()), top)
    mask = None
    if first_null and len(ids):
        starts = _offsets(lengths)[:-1]
        null = np.zeros(len(ids), dtype=bool)
        null[starts[lengths > 0]] = True
        mask = pa.array(null)
    steps = pa.StructArray.from_arrays(
        [pa.array(ids, pa.int32()), pa.array(lp, pa.float32()), top_lists],
        fields=list(_STEP),
        mask=mask,
    )
    return pa.ListArray.from_arrays(
        pa.array(_offsets(all_lengths), pa.int32()), steps, mask=_mask(valid)
    ).cast(OPTIONAL_COLUMNS["output_logprobs"])


def label_logprobs_array(values: Sequence[np.ndarray | None]) -> pa.Array:
    valid = np.array([v is not None for v in values], dtype=bool)
    lengths = np.array([0 if v is None else len(v) for v in values], dtype=np.int64)
    flat = [np.asarray(v, dtype=np.float32) for v in values if v is not None]
    vals = np.concatenate(flat) if flat else np.zeros(0, np.float32)
    return pa.ListArray.from_arrays(
        pa.array(_offsets(lengths), pa.int32()), pa.array(vals, pa.float32()), mask=_mask(valid)
    )


def optional_columns(rows: Sequence, schema: pa.Schema) -> dict[str, pa.Array]:
    """The optional columns of ``schema`` for a buffer of ``ResultRow``s."""
    out: dict[str, pa.Array] = {}
    if "output_logprobs" in schema.names:
        out["output_logprobs"] = logprobs_array(
            [r.output_token_ids for r in rows], [r.output_logprobs for r in rows]
        )
    if "prompt_logprobs" in schema.names:
        prompt = [r.prompt_logprobs for r in rows]  # (prompt ids, TokenLogprobs) or None
        out["prompt_logprobs"] = logprobs_array(
            [None if p is None else p[0] for p in prompt],
            [None if p is None else p[1] for p in prompt],
            first_null=True,
        )
    if "label_logprobs" in schema.names:
        out["label_logprobs"] = label_logprobs_array([r.label_logprobs for r in rows])
    if "label" in schema.names:
        out["label"] = pa.array([r.label for r in rows], pa.string())
    if "embedding" in schema.names:  # list<float32> as the label log-probs
        out["embedding"] = label_logprobs_array([r.embedding for r in rows])
    if REASONING_TEXT in schema.names:
        out[REASONING_TEXT] = pa.array([r.reasoning_text for r in rows], pa.string())
    return out
