"""The checks of an embedding job (``model.task = "embed"``) that span sections: nothing is
generated, so every generation setting is refused by name instead of silently ignored."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchjob.config.checks import _fail
from batchjob.config.per_row import ROW_SETTING_COLUMNS
from batchjob.config.sections import InputConfig, ModelConfig, OutputConfig, SamplingConfig

EMBED_ONLY = ("pooling", "normalize", "dimensions")  # [model] keys an embedding job reads
_UNSET = {"pooling": "auto", "normalize": None, "dimensions": None}
_MAX_TOKENS_COLUMN = InputConfig.__dataclass_fields__["max_tokens_column"].default
_WHY = 'does nothing with model.task = "embed" (nothing is generated)'


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def check_embedding(
    model: ModelConfig, sampling: SamplingConfig, inp: InputConfig, out: OutputConfig
) -> None:
    """ConfigError naming the first key that does not fit the job's ``model.task``."""
    if model.task != "embed":
        for key in EMBED_ONLY:
            value = getattr(model, key)
            if value != _UNSET[key]:
                _fail(f"model.{key}", 'is for model.task = "embed"', value)
        return
    for f in dataclasses.fields(SamplingConfig):
        value = getattr(sampling, f.name)
        if value != _default(f):
            _fail(f"sampling.{f.name}", _WHY, value)
    for name in ROW_SETTING_COLUMNS:
        if getattr(inp, name) is not None:
            _fail(f"input.{name}", _WHY, getattr(inp, name))
    if inp.max_tokens_column not in (None, _MAX_TOKENS_COLUMN):
        _fail("input.max_tokens_column", _WHY, inp.max_tokens_column)
    # no row decodes: a max_tokens column is data like any other (passed through)
    object.__setattr__(inp, "max_tokens_column", None)
    if out.format != "parquet":
        _fail("output.format", 'must be "parquet" with model.task = "embed"', out.format)
