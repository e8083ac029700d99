"""A ``max_tokens`` input column against ``sampling.max_tokens``: the column sets each row's
limit (a null row takes sampling.max_tokens), and from Python never silently: code that gives
sampling.max_tokens without naming the column gets one warning line saying the column
applied, and how to apply the job's limit to every row (``input.max_tokens_column = none``)."""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest

import batchjob
from batchjob.testing.workloads import WORDS

ENGINE = {"threads": 1, "kv_cache_bytes": "8MiB"}
MESSAGE = "input column 'max_tokens' sets each row's max_tokens"


@pytest.fixture
def table() -> pa.Table:
    prompts = [" ".join(WORDS[i : i + 12]) for i in range(0, 48, 12)]
    return pa.table({"prompt": prompts, "max_tokens": pa.array([5, 5, None, 5], pa.int32())})


def lengths(out: pa.Table) -> list[int]:
    return [len(t) for t in out["output_token_ids"].to_pylist()]


def test_the_column_wins_and_says_so_once(
    table: pa.Table, run_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = {"path": run_model, "device": "cpu"}
    sampling = {"max_tokens": 3, "ignore_eos": True}
    with caplog.at_level(logging.WARNING, logger="batchjob"):
        out = batchjob.generate(table, model=model, sampling=sampling, engine=ENGINE)
    assert lengths(out) == [5, 5, 3, 5]  # the column's, a null row: sampling.max_tokens
    assert caplog.text.count(MESSAGE) == 1, caplog.text
    assert "input.max_tokens_column = none to apply 3 to every row" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchjob"):
        with batchjob.Generator(model=model, sampling=sampling, engine=ENGINE) as g:
            g.generate(table)
            g.generate(table)
        off = batchjob.generate(
            table, model=model, sampling=sampling, input={"max_tokens_column": None}, engine=ENGINE
        )
    assert caplog.text.count(MESSAGE) == 1  # one line a job
    assert lengths(off) == [3, 3, 3, 3]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchjob"):
        named = {"max_tokens_column": "max_tokens"}
        batchjob.generate(table, model=model, sampling=sampling, input=named, engine=ENGINE)
        batchjob.generate(table, model=model, sampling={"ignore_eos": True}, engine=ENGINE)
    assert MESSAGE not in caplog.text  # the column named, or no job limit given: no question
