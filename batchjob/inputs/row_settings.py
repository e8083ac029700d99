"""Per-row settings: optional input columns that override ``[sampling]`` for one row.

Which settings, their column types, bounds and statuses: ``ROW_SETTINGS`` in
``batchjob.config.per_row`` (``input.temperature_column``, ..., the logits processors'
columns, ``labels_column`` for scoring, the output constraints of ``batchjob.inputs.row_guides``
and ``n_column``); this module reads and checks the rows' values. A
configured column that does not exist, or has the wrong type, is a dataset error
(exit 4); a null value takes the job's setting; a bad value rejects that row with a status
(``invalid_temperature``, ...) and a message naming the row and column, never the job. Token
ids (logit bias, allowed ids) must be below the model's vocabulary size.

The settings are keyed by ``row_id`` (sorted), so they survive any row selection of the
``TokenizedPrompts`` that carry them. Labels (per row or ``sampling.labels``) are tokenized
here, as continuations: the label text alone, no special tokens (write ``" Yes"`` when the
model expects the space).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchjob.config import InputConfig, ModelConfig, SamplingConfig
from batchjob.config.checks import plain
from batchjob.config.per_row import BY_COLUMN, ROW_SETTINGS, SAMPLING_FIELDS, RowSetting
from batchjob.errors import ConfigError, InputDataError
from batchjob.inputs.parquet import ROW_ID, RejectedRows
from batchjob.inputs.row_guides import GUIDE_FIELDS, read_guides
from batchjob.inputs.row_token_ids import check_token_ids, row_allowed, row_biases
from batchjob.status import STATUS_INVALID_SETTING, STATUS_PROMPT_TOO_LONG

STATUS_INVALID = STATUS_INVALID_SETTING
_UNSET = -1  # top_k / seed / min_tokens / n arrays: the row takes the job's value
# the kinds of the SamplingConfig fields a row can override (SAMPLING_FIELDS, in
# RowSettings.key order): NaN or _UNSET where the job's value applies
_FLOATS = tuple(s.name for s in ROW_SETTINGS if s.applies == "sampling" and s.kind == "number")
_INTS = tuple(s.name for s in ROW_SETTINGS if s.applies == "sampling" and s.kind == "integer")


def _allowed(st: RowSetting, v: np.ndarray) -> np.ndarray:
    """bool: which of a number setting's values ``v`` it allows (on either backend)."""
    lo, hi = st.bounds()
    return ((v > lo) if st.lo_open else (v >= lo)) & (v <= hi)


@dataclass(frozen=True)
class RowSettings:
    """Per-row overrides, keyed by row_id; None for a column the job does not use."""

    row_ids: np.ndarray  # int64 [M], sorted
    temperature: np.ndarray | None = None  # float64 [M], NaN: the job's value
    top_p: np.ndarray | None = None  # float64 [M], NaN: the job's value
    top_k: np.ndarray | None = None  # int64 [M], -1: the job's value
    seed: np.ndarray | None = None  # int64 [M], -1: the job's value
    stop: tuple[tuple[str, ...] | None, ...] | None = None  # [M], None: the job's value
    min_p: np.ndarray | None = None  # float64 [M], NaN: the job's value
    presence_penalty: np.ndarray | None = None  # float64 [M], NaN: the job's value
    frequency_penalty: np.ndarray | None = None  # float64 [M], NaN: the job's value
    repetition_penalty: np.ndarray | None = None  # float64 [M], NaN: the job's value
    min_tokens: np.ndarray | None = None  # int64 [M], -1: the job's value
    # [M] (token id, bias) pairs, biases clamped to [-100, 100]; None: the job's value
    logit_bias: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    allowed_token_ids: tuple[tuple[int, ...] | None, ...] | None = None  # [M], None: the job's
    labels: tuple[tuple[str, ...], ...] | None = None  # [M]: scoring mode (job labels filled)
    label_tokens: tuple[tuple[np.ndarray, ...], ...] | None = None  # [M]: int32 ids per label
    json_schema: tuple[str | None, ...] | None = None  # [M] compact JSON; None: the job's
    regex: tuple[str | None, ...] | None = None  # [M]; None: the job's constraint
    choice: tuple[str | None, ...] | None = None  # [M] choices as a JSON list; None: the job's
    n: np.ndarray | None = None  # int64 [M] samples of the row, -1: the job's sampling.n

    def index(self, row_id: int) -> int:
        i = int(np.searchsorted(self.row_ids, row_id))
        if i >= len(self.row_ids) or self.row_ids[i] != row_id:
            raise KeyError(f"row_id {row_id} has no settings")
        return i

    @property
    def overrides_sampling(self) -> bool:
        return any(getattr(self, f) is not None for f in SAMPLING_FIELDS)

    def key(self, i: int) -> tuple:
        """Row i's overrides as a hashable key, in ``SAMPLING_FIELDS`` order (None where the
        job's value applies)."""

        def one(name: str):
            a = getattr(self, name)
            if a is None:
                return None
            if name in _FLOATS:
                return None if math.isnan(a[i]) else float(a[i])
            if name in _INTS:
                return None if a[i] == _UNSET else int(a[i])
            return a[i]

        return tuple(one(name) for name in SAMPLING_FIELDS)

    @staticmethod
    def apply(base: SamplingConfig, key: tuple) -> SamplingConfig:
        """``base`` with a row's overrides (from ``key``)."""
        changes = {k: v for k, v in zip(SAMPLING_FIELDS, key, strict=True) if v is not None}
        return dataclasses.replace(base, **changes) if changes else base


def check_columns(inp: InputConfig, schema: pa.Schema, where: str) -> None:
    """Every configured per-row column exists with a usable type (else exit 4)."""
    for name, col in _configured(inp):
        if col not in schema.names:
            raise InputDataError(
                f"{where}: column {col!r} (input.{name}) not found; "
                f"available columns: {', '.join(n for n in schema.names if n != ROW_ID)}"
            )
        t = schema.field(col).type
        ok, want = _type_check(name, t)
        if not ok:
            raise InputDataError(
                f"{where}: column {col!r} (input.{name}) has type {t}; expected {want}"
            )


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_list_of(t: pa.DataType, item) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and item(t.value_type)


def _type_check(name: str, t: pa.DataType) -> tuple[bool, str]:
    """(whether column type ``t`` suits setting column ``name``, the type it needs)."""
    st = BY_COLUMN[name]
    kind = st.kind
    if kind == "text":
        ok = _is_text(t)
    elif kind == "number":
        ok = _is_number(t)
    elif kind == "integer":
        ok = pa.types.is_integer(t)
    elif kind == "token_ids":
        ok = _is_list_of(t, pa.types.is_integer)
    elif kind == "token_bias":
        ok = pa.types.is_map(t) and pa.types.is_integer(t.key_type) and _is_number(t.item_type)
    else:  # strings
        ok = _is_list_of(t, _is_text)
    return ok, st.column_type


def _configured(inp: InputConfig) -> list[tuple[str, str]]:
    return [(s.column, getattr(inp, s.column)) for s in ROW_SETTINGS if getattr(inp, s.column)]


def _column(table: pa.Table, col: str) -> pa.Array:
    arr = table.column(col).combine_chunks()
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def read_row_settings(
    inp: InputConfig,
    sampling: SamplingConfig,
    backend: str,
    passthrough: pa.Table,
    row_ids: np.ndarray,
    encode_labels=None,
    vocab_size: int | None = None,
) -> tuple[RowSettings | None, RejectedRows]:
    """Settings of the rows ``row_ids`` (sorted) from the pass-through table, and the rows
    whose values are invalid. ``encode_labels``: list[str] -> list of int32 id arrays (the
    tokenizer, no special tokens); needed in scoring mode. ``vocab_size``: token ids at or
    above it are invalid (None: not checked)."""
    cols = _configured(inp)
    scoring = bool(sampling.labels) or bool(inp.labels_column)
    if not cols and not scoring:
        return None, RejectedRows.empty()
    check_columns(inp, passthrough.schema, "input")
    pt_ids = passthrough.column(ROW_ID).to_numpy()
    order = np.argsort(pt_ids, kind="stable")
    take = pa.array(order[np.searchsorted(pt_ids, row_ids, sorter=order)])
    table = passthrough.take(take) if len(row_ids) else passthrough.slice(0, 0)
    m = len(row_ids)
    bad: dict[int, tuple[str, str]] = {}  # index -> (status, message), first problem wins

    def reject_one(i: int, name: str, col: str, what: str, v: object) -> None:
        if i not in bad:
            bad[i] = (
                STATUS_INVALID[name],
                f"row {int(row_ids[i])}: column {col!r} (input.{name}) = {plain(v)!r}: {what}",
            )

    def reject(mask: np.ndarray, name: str, col: str, what: str, values) -> None:
        for i in np.flatnonzero(mask):
            reject_one(int(i), name, col, what, values[int(i)])

    fields: dict[str, object] = {}
    guide_columns: dict[str, tuple[str, pa.Array]] = {}
    for name, col in cols:
        arr = _column(table, col)
        null = arr.is_null().to_numpy(zero_copy_only=False)
        st = BY_COLUMN[name]
        if st.kind == "number":  # one set of bounds, both backends
            v = arr.cast(pa.float64()).fill_null(math.nan).to_numpy(zero_copy_only=False)
            v = np.asarray(v, dtype=np.float64).copy()
            with np.errstate(invalid="ignore"):
                out = ~null & ~_allowed(st, v)
            reject(out, name, col, st.allowed(), v)
            v[null | out] = math.nan
            fields[name.removesuffix("_column")] = v
        elif st.kind == "integer":
            lo, hi = (int(b) for b in st.bounds())
            big = pc.fill_null(pc.greater(arr.cast(pa.float64()), float(hi)), False)
            big = big.to_numpy(zero_copy_only=False)
            v = arr.cast(pa.int64(), safe=False).fill_null(_UNSET).to_numpy(zero_copy_only=False)
            v = np.asarray(v, dtype=np.int64).copy()
            out = (~null & (v < lo)) | big
            what = st.allowed()
            reject(out, name, col, what, arr.to_pylist() if out.any() else v)
            if st.off is not None:  # vLLM's "off" (top_k = -1) is batchjob's
                v[~null & (v == st.off)] = int(st.lo or 0)
            v[null | out] = _UNSET
            fields[name.removesuffix("_column")] = v
        elif name in GUIDE_FIELDS:
            guide_columns[name] = (col, arr)
        elif name == "logit_bias_column":
            fields["logit_bias"] = row_biases(
                arr.to_pylist(),
                vocab_size,
                lambda i, w, v, c=col: reject_one(i, "logit_bias_column", c, w, v),
            )
        elif name == "allowed_token_ids_column":
            fields["allowed_token_ids"] = row_allowed(
                arr.to_pylist(),
                vocab_size,
                lambda i, w, v, c=col: reject_one(i, "allowed_token_ids_column", c, w, v),
            )
        else:
            lists = arr.to_pylist()
            vals: list[tuple[str, ...] | None] = []
            for i, x in enumerate(lists):
                if x is None:
                    vals.append(None)
                    continue
                t = tuple(x)
                if any(s is None or s == "" for s in t):
                    reject_one(i, name, col, "empty or null string", t)
                    vals.append(None)
                elif name == "labels_column" and len(set(t)) != len(t):
                    reject_one(i, name, col, "labels must be distinct", t)
                    vals.append(None)
                else:
                    vals.append(t)
            fields[name.removesuffix("_column")] = tuple(vals)
    if guide_columns:
        fields |= read_guides(guide_columns, m, reject_one, vllm=backend == "vllm")

    if scoring:
        row_labels = fields.pop("labels", None)
        default = tuple(sampling.labels) or None
        labels: list[tuple[str, ...]] = []
        for i in range(m):
            own = row_labels[i] if row_labels is not None else None  # type: ignore[index]
            lab = own or default
            if lab is None:
                if i not in bad:
                    lcol = inp.labels_column
                    bad[i] = (
                        STATUS_INVALID["labels_column"],
                        f"row {int(row_ids[i])}: column {lcol!r} (input.labels_column) is "
                        "null or empty and sampling.labels is not set",
                    )
                lab = ()
            labels.append(lab)
        if encode_labels is None:
            raise ConfigError("sampling.labels: scoring needs the model's tokenizer.json")
        fields["labels"] = tuple(labels)
        fields["label_tokens"] = _encode_labels(labels, encode_labels)

    keep = np.ones(m, dtype=bool)
    keep[list(bad)] = False
    settings = RowSettings(row_ids=np.asarray(row_ids, dtype=np.int64), **fields)  # type: ignore[arg-type]
    if not keep.all():
        settings = _select(settings, keep)
    idx = sorted(bad)
    rejected = RejectedRows(
        np.asarray(row_ids, dtype=np.int64)[idx],
        tuple(bad[i][0] for i in idx),
        tuple(bad[i][1] for i in idx),
    )
    return settings, rejected


def _encode_labels(labels: list[tuple[str, ...]], encode) -> tuple[tuple[np.ndarray, ...], ...]:
    """Each distinct label tokenized once."""
    distinct = sorted({s for lab in labels for s in lab})
    ids = dict(zip(distinct, encode(distinct), strict=True)) if distinct else {}
    for s, t in ids.items():
        if len(t) == 0:
            raise ConfigError(f"sampling.labels: label {s!r} encodes to no tokens")
    return tuple(tuple(ids[s] for s in lab) for lab in labels)


def _select(s: RowSettings, keep: np.ndarray) -> RowSettings:
    def pick(v):
        if v is None:
            return None
        if isinstance(v, np.ndarray):
            return v[keep]
        return tuple(x for x, k in zip(v, keep, strict=True) if k)

    return RowSettings(
        **{f.name: pick(getattr(s, f.name)) for f in dataclasses.fields(RowSettings)}
    )


def take_settings(s: RowSettings, which: np.ndarray) -> RowSettings:
    """The settings of rows ``which`` (int positions into ``s.row_ids``, in that order)."""
    which = np.asarray(which, dtype=np.int64)

    def pick(v):
        if v is None:
            return None
        if isinstance(v, np.ndarray):
            return v[which]
        return tuple(v[i] for i in which.tolist())

    return RowSettings(
        **{f.name: pick(getattr(s, f.name)) for f in dataclasses.fields(RowSettings)}
    )


def settings_of_rows(s: RowSettings, row_ids: np.ndarray) -> RowSettings:
    """The settings of ``row_ids`` (sorted, each in ``s``)."""
    return take_settings(s, np.searchsorted(s.row_ids, row_ids))


def concat_settings(parts: list[RowSettings]) -> RowSettings:
    """Settings of disjoint row sets one after another (row ids ascending across them), as
    one: every part of one job has the same fields set."""
    if len(parts) == 1:
        return parts[0]

    def join(name: str):
        vals = [getattr(p, name) for p in parts]
        if vals[0] is None:
            return None
        if isinstance(vals[0], np.ndarray):
            return np.concatenate(vals)
        return tuple(x for v in vals for x in v)

    return RowSettings(**{f.name: join(f.name) for f in dataclasses.fields(RowSettings)})


def with_row_settings(
    inp: InputConfig,
    sampling: SamplingConfig,
    model: ModelConfig,
    backend: str,
    loaded,
    tokenizer,
    max_model_len: int | None,
    vocab_size: int | None = None,
):
    """``TokenizedInput`` with its prompts carrying the rows' settings, and the rows with an
    invalid value moved to the rejected rows (``batchjob.tokenize.batched.load_prompts`` calls it).
    Scoring: a row whose prompt + longest label exceeds ``max_model_len`` is rejected too.
    ``vocab_size``: the model's; the job's token ids at or above it are a ConfigError."""
    prompts = loaded.prompts
    encode = None
    scoring = bool(sampling.labels or inp.labels_column)
    # stop strings are matched on text, labels are tokenized: both need the model's tokenizer
    if (inp.stop_column or scoring) and tokenizer is None:
        from batchjob.tokenize.tokenizer import load_tokenizer  # ModelError without tokenizer.json

        tokenizer = load_tokenizer(model.tokenizer_path)
    if scoring:
        assert tokenizer is not None
        tok = tokenizer.tokenizer

        def encode(texts: list[str]) -> list[np.ndarray]:
            encs = tok.encode_batch_fast(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    check_token_ids(sampling, vocab_size)
    settings, bad = read_row_settings(
        inp, sampling, backend, loaded.passthrough, prompts.row_ids, encode, vocab_size
    )
    if settings is None:
        return loaded
    if settings.label_tokens is not None and max_model_len is not None:
        settings, bad = _labels_within_context(settings, bad, prompts, max_model_len)
    keep = ~np.isin(prompts.row_ids, bad.row_ids)
    if not keep.all():
        lengths = prompts.lengths[keep]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        prompts = dataclasses.replace(
            prompts,
            row_ids=prompts.row_ids[keep],
            tokens=prompts.tokens[np.repeat(keep, prompts.lengths)],
            offsets=offsets,
            max_tokens=prompts.max_tokens[keep],
        )
    prompts = dataclasses.replace(prompts, settings=settings)
    if settings.label_tokens is not None:  # scoring: KV for the prompt + the longest label
        longest = [max(len(t) for t in lab) for lab in settings.label_tokens]
        prompts = dataclasses.replace(prompts, max_tokens=np.asarray(longest, dtype=np.int32))
    rejected = RejectedRows.concat([loaded.rejected, bad])
    return dataclasses.replace(loaded, prompts=prompts, rejected=rejected)


def _labels_within_context(
    settings: RowSettings, bad: RejectedRows, prompts, max_model_len: int
) -> tuple[RowSettings, RejectedRows]:
    """Reject (prompt_too_long) the rows whose prompt + longest label does not fit the
    context: the longest label's last token is scored at position prompt + label - 1."""
    assert settings.label_tokens is not None
    longest = np.array([max(len(t) for t in lab) for lab in settings.label_tokens], np.int64)
    pos = np.searchsorted(prompts.row_ids, settings.row_ids)
    need = prompts.lengths[pos] + longest - 1
    over = need > max_model_len - 1
    if not over.any():
        return settings, bad
    idx = np.flatnonzero(over)
    extra = RejectedRows(
        settings.row_ids[idx],
        tuple(STATUS_PROMPT_TOO_LONG for _ in idx),
        tuple(
            f"row {int(settings.row_ids[i])}: prompt + longest label = {int(need[i]) + 1} "
            f"tokens exceeds max_model_len = {max_model_len}"
            for i in idx
        ),
    )
    return _select(settings, ~over), RejectedRows.concat([bad, extra])
