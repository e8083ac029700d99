"""vLLM refuses a temperature above 2 (its SamplingParams): on ``engine.backend = "vllm"``
a job-wide one is exit 3 at load, a row's is that row's ``invalid_temperature``; the native
engine takes up to 100. Checked without starting vLLM."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from batchjob.config import InputConfig, SamplingConfig, load_job
from batchjob.errors import ConfigError
from batchjob.inputs.parquet import ROW_ID
from batchjob.inputs.row_settings import read_row_settings


def test_job_wide_temperature_above_2_is_refused_on_vllm_only():
    sets = {"input.path": "x.parquet", "output.path": "o.parquet", "sampling.temperature": "2.5"}
    with pytest.raises(ConfigError, match=r"sampling.temperature.*\[0, 2\]"):
        load_job(None, {**sets, "engine.backend": "vllm"})
    assert load_job(None, sets).sampling.temperature == 2.5


@pytest.mark.parametrize("backend,bad", [("vllm", [2]), ("native", [])])
def test_row_temperature_above_2_rejects_the_row_on_vllm(backend, bad):
    table = pa.table({ROW_ID: np.arange(3), "t": [1.0, 2.0, 2.5]})
    inp = InputConfig(path="x.parquet", temperature_column="t")
    _, rejected = read_row_settings(inp, SamplingConfig(), backend, table, np.arange(3))
    assert rejected.row_ids.tolist() == bad
    if bad:
        assert rejected.status[0] == "invalid_temperature"
        assert "[0, 2] on engine.backend = vllm" in rejected.message[0]
