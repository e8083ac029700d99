"""``generate_batches`` over a stream longer than memory: each window (an input table, or a
slice of one over ``scheduler.plan_memory``) planned and run on its own, so the Python heap's
peak follows the window, not the stream; results equal ``generate`` over the whole."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import batchjob
from batchjob.api import generate_config, window_rows
from tests.e2e.jobkit import build_model

ENGINE = {"kv_cache_bytes": "8MiB", "threads": 1}
SAMPLING = {"max_tokens": 1}


@pytest.fixture(scope="module")
def run_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("gen-model") / "tiny")


def _table(seed: int, rows: int) -> pa.Table:
    """Token-id prompts: 8 groups of a 6-token prefix + 4 tokens of their own."""
    rng = np.random.default_rng(seed)
    heads = rng.integers(3, 2000, (8, 6))
    ids = [heads[i % 8].tolist() + rng.integers(3, 2000, 4).tolist() for i in range(rows)]
    return pa.table({"prompt": pa.array(ids, pa.list_(pa.int32())), "tag": [seed] * rows})


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_window_rows_follow_plan_memory(tmp_path: Path, run_model: Path) -> None:
    t = _table(0, 4000)
    job = generate_config(run_model)
    assert window_rows(t, job) == 4000  # half of RAM: one window
    small = generate_config(run_model, scheduler={"plan_memory": "64KiB"})
    rows = window_rows(t, small)
    assert 1 <= rows < 4000
    assert 280 * rows + 6 * 10 * rows <= 64 * 1024  # the window's estimate within the budget


def test_stream_memory_follows_the_window_not_the_stream(run_model: Path) -> None:
    settings = {"model": run_model, "sampling": SAMPLING, "engine": ENGINE}
    with batchjob.Generator(**settings) as g:
        g.generate(_table(99, 50))  # the model loaded before anything is measured

        def stream(n: int) -> None:
            for out in g.generate_batches(_table(i, 300) for i in range(n)):
                assert out.num_rows == 300

        short, long = _peak(lambda: stream(2)), _peak(lambda: stream(8))
        assert long < 1.25 * short, (short, long)  # 4x the rows, the same peak

        # one table over plan_memory: planned and run in windows, peak as a window's
        windowed = dict(settings, scheduler={"plan_memory": "64KiB"})
    with batchjob.Generator(**windowed) as w:
        w.generate(_table(99, 50))
        big = _table(7, 2400)
        one = _peak(lambda: list(w.generate_batches(_table(7, 300))))
        whole = _peak(lambda: list(w.generate_batches([big])))
        # the result table of 2,400 rows is held whole; planning is not
        assert whole < 3 * one, (one, whole)


def test_windows_equal_one_plan_row_for_row(run_model: Path) -> None:
    big = _table(3, 1200)
    settings = {"model": run_model, "sampling": SAMPLING, "engine": ENGINE}
    want = batchjob.generate(big, **settings)
    (got,) = batchjob.generate_batches([big], **settings, scheduler={"plan_memory": "64KiB"})
    assert got.num_rows == 1200
    assert got.equals(want)
    parts = list(batchjob.generate_batches((big.slice(s, 400) for s in (0, 400, 800)), **settings))
    assert pa.concat_tables(parts).equals(want)
