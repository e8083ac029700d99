"""In-memory input: one Arrow table read as the job's dataset (``batchjob.generate``'s data, an
OpenAI Batch file once parsed). It streams the same ``PromptBatch``es as a Parquet dataset, so
everything after reading (prompt building, tokenizing, per-row settings) is the same code.

Row ids: ``row_base`` + the row's index in the table; a caller that runs a long stream table
after table passes the rows read so far, so ids stay unique and in input order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from batchjob.config import InputConfig, ModelConfig
from batchjob.errors import InputDataError
from batchjob.inputs.parquet import (
    InputDataset,
    PromptBatch,
    check_schema,
    requires_max_tokens_column,
)
from batchjob.inputs.prompt_builder import PromptBuilder, make_builder

DATA_NAME = "<data>"  # how messages name an in-memory table (where a file name would be)


@dataclass(frozen=True)
class TableDataset(InputDataset):
    """An Arrow table held in memory, read in slices of ``batch_rows`` rows."""

    table: pa.Table | None = None
    row_base: int = 0  # the row_id of the table's first row

    def batches(self) -> Iterator[PromptBatch]:
        assert self.table is not None
        name = self.files[0]
        for start in range(0, self.num_rows, self.batch_rows):
            n = min(self.batch_rows, self.num_rows - start)
            rb = self.table.slice(start, n).combine_chunks().to_batches()[0]
            yield self._to_prompt_batch(rb, name, self.row_base + start, start)


def open_table(
    cfg: InputConfig,
    model: ModelConfig | None,
    table: pa.Table,
    *,
    name: str = DATA_NAME,
    row_base: int = 0,
    builder: PromptBuilder | None = None,
) -> TableDataset:
    """Validate ``table``'s columns against ``[input]`` as ``open_dataset`` does a file's.

    ``builder``: the reader's own prompt builder (OpenAI requests); else the job's
    (``input.template``, ``messages_column``, the chat template of ``model``)."""
    builder = builder if builder is not None else make_builder(cfg, model)
    is_text, has_mt = check_schema(cfg, builder, table.schema, name)
    if requires_max_tokens_column(cfg) and not has_mt:
        raise InputDataError(
            f"{name}: column {cfg.max_tokens_column!r} (input.max_tokens_column) not found; "
            f"available columns: {', '.join(table.schema.names)}"
        )
    return TableDataset(
        files=(name,),
        file_rows=(table.num_rows,),
        prompt_column=cfg.prompt_column,
        prompt_is_text=is_text,
        max_tokens_column=cfg.max_tokens_column if has_mt else None,
        batch_rows=cfg.batch_rows,
        limit=cfg.limit,
        builder=builder,
        table=table,
        row_base=row_base,
    )
