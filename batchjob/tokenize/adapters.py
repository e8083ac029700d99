"""Which LoRA adapter each prompt runs with (``model.adapters``): the row's
``input.adapter_column`` value, else ``model.adapter``, else the base model. A row naming an
adapter the job does not have is rejected (``invalid_adapter``); the rest run. The result is
``TokenizedPrompts.adapter`` (an index into ``model.adapters``, -1 for the base model), by
which the plan keys its groups (``plan.build``) and the backends pick the weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from batchjob.errors import InputDataError
from batchjob.inputs.parquet import ROW_ID, RejectedRows
from batchjob.status import STATUS_INVALID_ADAPTER
from batchjob.tokenize.batched import TokenizedInput


def assign_adapters(
    loaded: TokenizedInput, names: Sequence[str], column: str | None, default: str | None
) -> TokenizedInput:
    """``loaded`` with ``prompts.adapter`` set (unchanged when the job has no adapters)."""
    if not names:
        return loaded
    prompts = loaded.prompts
    fallback = list(names).index(default) if default is not None else -1
    index = np.full(len(prompts), fallback, dtype=np.int32)
    bad = np.zeros(len(prompts), dtype=bool)
    messages: list[str] = []
    if column is not None:
        table = loaded.passthrough
        if column not in table.column_names:
            raise InputDataError(f"input.adapter_column: the input has no column {column!r}")
        values = table[column]
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            raise InputDataError(
                f"input.adapter_column: column {column!r} must hold strings, not {values.type}"
            )
        by_row = dict(zip(table[ROW_ID].to_pylist(), values.to_pylist(), strict=True))
        known = {n: i for i, n in enumerate(names)}
        for i, rid in enumerate(prompts.row_ids.tolist()):
            v = by_row.get(rid)
            if v is None:
                continue
            if v in known:
                index[i] = known[v]
            else:
                bad[i] = True
                messages.append(
                    f"row {rid}: input.adapter_column {column!r} = {v!r} names none of "
                    f"model.adapters ({', '.join(names)})"
                )
    prompts = dataclasses.replace(prompts, adapter=index)
    if not bad.any():
        return dataclasses.replace(loaded, prompts=prompts)
    ids = prompts.row_ids[bad]
    rejected = RejectedRows(ids, (STATUS_INVALID_ADAPTER,) * len(ids), tuple(messages))
    both = RejectedRows.concat([loaded.rejected, rejected])
    order = np.argsort(both.row_ids, kind="stable")
    both = RejectedRows(
        both.row_ids[order],
        tuple(both.status[i] for i in order),
        tuple(both.message[i] for i in order),
    )
    return dataclasses.replace(loaded, prompts=prompts.take(~bad), rejected=both)
