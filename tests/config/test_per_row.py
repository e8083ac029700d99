"""The per-row settings are declared once (``batchjob.config.per_row.ROW_SETTINGS``): the
``[input]`` columns, the ``[sampling]`` keys, the rows' values and their statuses follow it,
and a job's value and a row's value are refused at the same bounds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pytest

from batchjob.config import InputConfig, SamplingConfig
from batchjob.config.per_row import INT64_MAX, ROW_SETTING_COLUMNS, ROW_SETTINGS
from batchjob.errors import ConfigError
from batchjob.inputs.parquet import ROW_ID
from batchjob.inputs.row_settings import RowSettings, read_row_settings
from batchjob.status import STATUS_INVALID_SETTING


def test_the_sections_declare_the_tables_settings() -> None:
    inputs = [f.name for f in dataclasses.fields(InputConfig) if f.name in ROW_SETTING_COLUMNS]
    assert tuple(inputs) == ROW_SETTING_COLUMNS
    sampling = {f.name for f in dataclasses.fields(SamplingConfig)}
    rows = {f.name for f in dataclasses.fields(RowSettings)}
    for s in ROW_SETTINGS:
        assert s.name in sampling and s.name in rows, s.name
        assert STATUS_INVALID_SETTING[s.column] == f"invalid_{s.name}"


def _edges(s) -> list[float]:
    """Values just inside and just outside a number or integer setting's bounds."""
    lo, hi = s.bounds()
    if s.kind == "integer":
        out = [lo - 1, lo] + ([] if int(hi) == INT64_MAX else [hi, hi + 1])
        return [int(v) for v in out]
    out = [math.nextafter(lo, -math.inf), lo, math.nextafter(lo, math.inf), hi]
    return out + ([math.nextafter(hi, math.inf)] if hi < 1e6 else [])


@pytest.mark.parametrize("s", [s for s in ROW_SETTINGS if s.lo is not None], ids=lambda s: s.name)
def test_a_job_value_and_a_row_value_are_refused_at_the_same_bounds(s) -> None:
    values = _edges(s)
    job_ok = []
    for v in values:
        try:
            SamplingConfig(**{s.name: v})
            job_ok.append(True)
        except ConfigError:
            job_ok.append(False)
    arrow = pa.int64() if s.kind == "integer" else pa.float64()
    table = pa.table({ROW_ID: np.arange(len(values)), "c": pa.array(values, arrow)})
    inp = InputConfig(path="x.parquet", **{s.column: "c"})
    _, rejected = read_row_settings(inp, SamplingConfig(), "native", table, np.arange(len(values)))
    row_ok = [i not in set(rejected.row_ids.tolist()) for i in range(len(values))]
    assert job_ok == row_ok, (s.name, values)
    assert set(rejected.status) <= {s.status}
    assert any(job_ok) and not all(job_ok)
