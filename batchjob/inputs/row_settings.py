"""Per-row settings: optional input columns that override ``[sampling]`` for one row.

``input.temperature_column``, ``top_p_column``, ``top_k_column``, ``seed_column``,
``stop_column`` (list<string>), ``labels_column`` (list<string>, scoring mode) and
``json_schema_column`` (string: a JSON schema, structured output) name the columns. A
configured column that does not exist, or has the wrong type, is a dataset error
(exit 4); a null value takes the job's setting; a bad value rejects that row with a status
(``invalid_temperature``, ...) and a message naming the row and column, never the job.

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
from batchjob.errors import ConfigError, InputDataError
from batchjob.inputs.parquet import ROW_ID, RejectedRows
from batchjob.status import STATUS_INVALID_SETTING, STATUS_PROMPT_TOO_LONG

STATUS_INVALID = STATUS_INVALID_SETTING
_NUMERIC = ("temperature_column", "top_p_column")
_INTEGER = ("top_k_column", "seed_column")
_STRINGS = ("stop_column", "labels_column")
_UNSET = -1  # top_k / seed arrays: the row takes the job's value
_INT63 = 2**63 - 1


@dataclass(frozen=True)
class RowSettings:
    """Per-row overrides, keyed by row_id; None for a column the job does not use."""

    row_ids: np.ndarray  # int64 [M], sorted
    temperature: np.ndarray | None = None  # float64 [M], NaN: the job's value
    top_p: np.ndarray | None = None  # float64 [M], NaN: the job's value
    top_k: np.ndarray | None = None  # int64 [M], -1: the job's value
    seed: np.ndarray | None = None  # int64 [M], -1: the job's value
    stop: tuple[tuple[str, ...] | None, ...] | None = None  # [M], None: the job's value
    labels: tuple[tuple[str, ...], ...] | None = None  # [M]: scoring mode (job labels filled)
    label_tokens: tuple[tuple[np.ndarray, ...], ...] | None = None  # [M]: int32 ids per label
    json_schema: tuple[str | None, ...] | None = None  # [M] compact JSON; None: the job's

    def index(self, row_id: int) -> int:
        i = int(np.searchsorted(self.row_ids, row_id))
        if i >= len(self.row_ids) or self.row_ids[i] != row_id:
            raise KeyError(f"row_id {row_id} has no settings")
        return i

    @property
    def overrides_sampling(self) -> bool:
        return any(
            getattr(self, f) is not None for f in ("temperature", "top_p", "top_k", "seed", "stop")
        )

    def key(self, i: int) -> tuple:
        """Row i's overrides as a hashable key (None where the job's value applies)."""

        def f(a: np.ndarray | None) -> float | None:
            return None if a is None or math.isnan(a[i]) else float(a[i])

        def n(a: np.ndarray | None) -> int | None:
            return None if a is None or a[i] == _UNSET else int(a[i])

        stop = None if self.stop is None else self.stop[i]
        return (f(self.temperature), f(self.top_p), n(self.top_k), n(self.seed), stop)

    @staticmethod
    def apply(base: SamplingConfig, key: tuple) -> SamplingConfig:
        """``base`` with a row's overrides (from ``key``)."""
        names = ("temperature", "top_p", "top_k", "seed", "stop")
        changes = {k: v for k, v in zip(names, key, strict=True) if v is not None}
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
        ok = (
            (pa.types.is_string(t) or pa.types.is_large_string(t))
            if name == "json_schema_column"
            else (pa.types.is_integer(t) or pa.types.is_floating(t))
            if name in _NUMERIC
            else pa.types.is_integer(t)
            if name in _INTEGER
            else (pa.types.is_list(t) or pa.types.is_large_list(t))
            and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type))
        )
        if not ok:
            want = {"_N": "a number", "_I": "an integer", "_S": "list<string>", "_J": "string"}[
                "_J"
                if name == "json_schema_column"
                else "_N"
                if name in _NUMERIC
                else "_I"
                if name in _INTEGER
                else "_S"
            ]
            raise InputDataError(
                f"{where}: column {col!r} (input.{name}) has type {t}; expected {want}"
            )


def _configured(inp: InputConfig) -> list[tuple[str, str]]:
    return [(n, getattr(inp, n)) for n in STATUS_INVALID if getattr(inp, n)]


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
) -> tuple[RowSettings | None, RejectedRows]:
    """Settings of the rows ``row_ids`` (sorted) from the pass-through table, and the rows
    whose values are invalid. ``encode_labels``: list[str] -> list of int32 id arrays (the
    tokenizer, no special tokens); needed in scoring mode."""
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
                f"row {int(row_ids[i])}: column {col!r} (input.{name}) = {v!r}: {what}",
            )

    def reject(mask: np.ndarray, name: str, col: str, what: str, values) -> None:
        for i in np.flatnonzero(mask):
            reject_one(int(i), name, col, what, values[int(i)])

    fields: dict[str, object] = {}
    for name, col in cols:
        arr = _column(table, col)
        null = arr.is_null().to_numpy(zero_copy_only=False)
        if name in _NUMERIC:
            v = arr.cast(pa.float64()).fill_null(math.nan).to_numpy(zero_copy_only=False)
            v = np.asarray(v, dtype=np.float64).copy()
            if name == "temperature_column":
                out = ~null & ~((v >= 0) & (v <= 100))
                reject(out, name, col, "must be in [0, 100]", v)
            else:
                out = ~null & ~((v > 0) & (v <= 1))
                reject(out, name, col, "must be in (0, 1]", v)
            v[null | out] = math.nan
            fields[name.removesuffix("_column")] = v
        elif name in _INTEGER:
            big = pc.fill_null(pc.greater(arr.cast(pa.float64()), float(_INT63)), False)
            big = big.to_numpy(zero_copy_only=False)
            v = arr.cast(pa.int64(), safe=False).fill_null(_UNSET).to_numpy(zero_copy_only=False)
            v = np.asarray(v, dtype=np.int64).copy()
            out = (~null & (v < 0)) | big
            reject(out, name, col, "must be >= 0", arr.to_pylist() if out.any() else v)
            v[null | out] = _UNSET
            fields[name.removesuffix("_column")] = v
        elif name == "json_schema_column":
            fields["json_schema"] = _row_schemas(
                arr.to_pylist(),
                lambda i, w, v, n=name, c=col: reject_one(i, n, c, w, v),
                vllm=backend == "vllm",
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


def _row_schemas(texts: list[str | None], reject, vllm: bool) -> tuple[str | None, ...]:
    """Each distinct schema checked and compacted once; a bad one rejects its rows."""
    from batchjob.config.json_schema import compact_json_schema

    done: dict[str, str | ValueError] = {}
    out: list[str | None] = []
    for i, t in enumerate(texts):
        if t is None:
            out.append(None)
            continue
        c = done.get(t)
        if c is None:
            try:
                c = done[t] = compact_json_schema(t, vllm)
            except ValueError as e:
                c = done[t] = e
        if isinstance(c, ValueError):
            reject(i, str(c), t if len(t) <= 80 else t[:77] + "...")
            out.append(None)
        else:
            out.append(c)
    return tuple(out)


def row_json_schemas(sampling: SamplingConfig, prompts) -> list[str | None] | None:
    """The JSON schema of each prompt position (its row's, else ``sampling.json_schema``);
    None when no row is constrained."""
    rs = prompts.settings
    if rs is None or rs.json_schema is None:
        if sampling.json_schema is None:
            return None
        return [sampling.json_schema] * len(prompts)
    own = rs.json_schema
    out = [own[rs.index(int(r))] or sampling.json_schema for r in prompts.row_ids]
    return out if any(s is not None for s in out) else None


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


def with_row_settings(
    inp: InputConfig,
    sampling: SamplingConfig,
    model: ModelConfig,
    backend: str,
    loaded,
    tokenizer,
    max_model_len: int | None,
):
    """``TokenizedInput`` with its prompts carrying the rows' settings, and the rows with an
    invalid value moved to the rejected rows (``batchjob.tokenize.batched.load_prompts`` calls it).
    Scoring: a row whose prompt + longest label exceeds ``max_model_len`` is rejected too."""
    prompts = loaded.prompts
    encode = None
    scoring = bool(sampling.labels or inp.labels_column)
    # stop strings are matched on text, labels are tokenized: both need the model's tokenizer
    if (inp.stop_column or scoring) and tokenizer is None:
        from batchjob.tokenize.tokenizer import load_tokenizer  # ModelError without tokenizer.json

        tokenizer = load_tokenizer(model.path)
    if scoring:
        assert tokenizer is not None
        tok = tokenizer.tokenizer

        def encode(texts: list[str]) -> list[np.ndarray]:
            encs = tok.encode_batch_fast(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    settings, bad = read_row_settings(
        inp, sampling, backend, loaded.passthrough, prompts.row_ids, encode
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
