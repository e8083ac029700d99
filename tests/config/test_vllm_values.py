"""vLLM-shaped values taken where they map one to one (a ``vllm.SamplingParams`` object,
``top_k = -1``, a JSON schema as a table, an engine argument where batchjob's keys go), and
one set of bounds on both backends (a job valid on one runs on the other). Checked without
starting vLLM."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from batchjob.api import generate_config
from batchjob.config import InputConfig, SamplingConfig, load_job
from batchjob.errors import ConfigError
from batchjob.inputs.parquet import ROW_ID
from batchjob.inputs.row_settings import read_row_settings
from tests.backends.vllm.vllm_kit import needs_vllm

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FILES = {"input.path": "x.parquet", "output.path": "o.parquet"}


@needs_vllm
def test_a_sampling_params_object_maps_field_for_field():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        max_tokens=8,
        temperature=0.5,
        top_k=-1,
        seed=3,
        stop="END",
        logprobs=2,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    s = generate_config(model="m", sampling=params).sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, s.stop, s.logprobs) == (
        8, 0.5, 0, 3, ("END",), 2
    )  # fmt: skip
    assert json.loads(s.json_schema or "") == SCHEMA
    # vLLM's defaults come along: SamplingParams() samples at temperature 1.0, 16 tokens
    plain = generate_config(model="m", sampling=SamplingParams()).sampling
    assert (plain.temperature, plain.max_tokens, plain.top_p) == (1.0, 16, 1.0)
    with pytest.raises(ConfigError, match=r"SamplingParams.flat_logprobs = True has no batchjob"):
        generate_config(model="m", sampling=SamplingParams(flat_logprobs=True))


def test_top_k_minus_one_is_off_job_wide_and_per_row():
    assert load_job(None, {**FILES, "sampling.top_k": "-1"}).sampling.top_k == 0
    with pytest.raises(ConfigError, match=r"sampling.top_k: must be >= 0"):
        SamplingConfig(top_k=-2)
    table = pa.table({ROW_ID: np.arange(3), "k": [-1, 5, -2]})
    inp = InputConfig(path="x.parquet", top_k_column="k")
    rows, rejected = read_row_settings(inp, SamplingConfig(top_k=7), "native", table, np.arange(3))
    assert rejected.row_ids.tolist() == [2] and "(or -1: off)" in rejected.message[0]
    assert rows is not None and rows.top_k[:2].tolist() == [0, 5]  # off, not the job's 7


def test_a_json_schema_given_as_a_table():
    s = generate_config(model="m", sampling={"json_schema": SCHEMA}).sampling
    assert json.loads(s.json_schema or "") == SCHEMA


def test_engine_arguments_where_batchjob_keys_go_name_engine_vllm():
    with pytest.raises(ConfigError, match=r"engine=\{'backend': 'vllm', 'vllm': \{'tensor_par"):
        generate_config(model="m", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"goes in engine.vllm.tensor_parallel_size"):
        load_job(None, {**FILES, "engine.tensor_parallel_size": "2"})
    with pytest.raises(ConfigError, match=r"model=\{'dtype'"):  # batchjob's own key wins
        generate_config(model="m", dtype="bfloat16")


@pytest.mark.parametrize("backend", ["native", "vllm"])
def test_one_set_of_bounds_on_both_backends(backend):
    sets = {**FILES, "engine.backend": backend}
    with pytest.raises(ConfigError, match=r"sampling.temperature: must be in \[0.0, 2.0\]"):
        load_job(None, {**sets, "sampling.temperature": "2.5"})
    assert load_job(None, {**sets, "sampling.temperature": "2"}).sampling.temperature == 2.0
    table = pa.table({ROW_ID: np.arange(3), "t": [1.0, 2.0, 2.5]})
    inp = InputConfig(path="x.parquet", temperature_column="t")
    _, rejected = read_row_settings(inp, SamplingConfig(), backend, table, np.arange(3))
    assert rejected.row_ids.tolist() == [2] and rejected.status[0] == "invalid_temperature"
    assert rejected.message[0].endswith("= 2.5: must be in [0, 2]"), rejected.message[0]
