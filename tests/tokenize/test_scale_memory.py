"""The reading path's memory fixes give the same prompts as the plain way.

``PromptsBuilder`` writes batches straight into preallocated arrays (instead of collecting
them and concatenating at the end) and ``tokenize_dataset`` sizes its token array from the
Parquet metadata; the reader iterates row groups with ``ParquetFile.iter_batches`` instead of
the dataset scanner. Each is compared with a reference built row by row from
``pq.read_table``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import InputConfig
from batchjob.inputs.parquet import open_dataset
from batchjob.tokenize.batched import _token_capacity, tokenize_dataset
from batchjob.tokenize.prompts import PromptsBuilder, TokenizedPrompts


def _equal(a: TokenizedPrompts, b: TokenizedPrompts) -> None:
    for name in ("row_ids", "tokens", "offsets", "max_tokens"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("capacity", [0, 1, 10**6], ids=["grow", "tiny", "ample"])
def test_builder_equals_from_lists(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    seqs: list[np.ndarray] = []
    mts: list[int] = []
    built = PromptsBuilder(capacity, capacity)
    for batch in range(40):  # 40 batches of 0-80 rows: crosses every initial capacity
        n = int(rng.integers(0, 80))
        rows = [rng.integers(0, 5000, size=int(rng.integers(1, 60))) for _ in range(n)]
        mt = rng.integers(1, 100, size=n)
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        tokens = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
        ids = np.arange(len(seqs), len(seqs) + n, dtype=np.int64) * 3 + batch
        built.add(ids, tokens, lengths, mt.astype(np.int32))
        seqs += rows
        mts += mt.tolist()
    got = built.build()
    want = TokenizedPrompts.from_lists(seqs, got.row_ids, np.array(mts))
    _equal(got, want)
    assert got.tokens.dtype == np.int32 and got.offsets.dtype == np.int64


def _ids_dataset(folder: Path, rng: np.random.Generator) -> list[list[int] | None]:
    """Two files, several row groups each, with null rows, empty lists and null ids."""
    folder.mkdir()
    everything: list[list[int] | None] = []
    for f in range(2):
        rows: list[list[int] | None] = []
        for _ in range(157):
            k = int(rng.integers(0, 30))
            row = rng.integers(0, 1000, size=k).tolist()
            if rng.random() < 0.05:
                row = None
            elif k and rng.random() < 0.05:
                row[0] = None
            rows.append(row)
        t = pa.table({"prompt": pa.array(rows, pa.list_(pa.int32())), "k": range(len(rows))})
        pq.write_table(t, folder / f"part-{f}.parquet", row_group_size=23)
        everything += rows
    return everything


def test_token_ids_read_equal_row_by_row_reference(tmp_path: Path) -> None:
    rows = _ids_dataset(tmp_path / "d", np.random.default_rng(0))
    ds = open_dataset(InputConfig(path=str(tmp_path / "d"), batch_rows=10))
    valid = [r for r in rows if r and None not in r]
    assert _token_capacity(ds) >= sum(len(r) for r in valid)
    res = tokenize_dataset(ds, None, default_max_tokens=7, max_model_len=None, vocab_size=1000)
    ids = [i for i, r in enumerate(rows) if r and None not in r]
    want = TokenizedPrompts.from_lists(valid, np.array(ids), 7)
    _equal(res.prompts, want)
    assert len(res.rejected) == len(rows) - len(valid)
    # the pass-through columns come in row order with the right row ids, across row groups
    k = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "d").iterdir()))["k"]
    assert res.passthrough["k"].to_pylist() == k.to_pylist()
    assert res.passthrough["row_id"].to_pylist() == list(range(len(rows)))


def test_limit_stops_mid_row_group(tmp_path: Path) -> None:
    rows = _ids_dataset(tmp_path / "d", np.random.default_rng(1))
    ds = open_dataset(InputConfig(path=str(tmp_path / "d"), batch_rows=8, limit=200))
    res = tokenize_dataset(ds, None, default_max_tokens=3, max_model_len=None, vocab_size=1000)
    assert res.num_rows == 200
    ids = [i for i, r in enumerate(rows[:200]) if r and None not in r]
    np.testing.assert_array_equal(res.prompts.row_ids, ids)


def _shared_rows(n: int, seed: int) -> pa.Table:
    """``n`` token-id rows in groups of ~10 sharing a 20-token prefix, 5 distinct tokens each."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 1000, size=(n // 10 + 1, 20), dtype=np.int32)
    tokens = np.concatenate(
        [prefixes[np.arange(n) // 10], rng.integers(0, 1000, size=(n, 5), dtype=np.int32)], 1
    )
    offsets = np.arange(0, 25 * n + 1, 25, dtype=np.int32)
    prompt = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens.ravel()))
    return pa.table({"prompt": prompt, "k": np.arange(n)})


def test_reading_and_planning_keep_no_python_object_per_row(tmp_path: Path) -> None:
    """What `batchjob plan` holds after reading and planning is arrays, not per-row objects:
    the number of live allocations stays far below the row count."""
    import tracemalloc

    from batchjob.config import load_job
    from batchjob.plan.build import build_plan
    from batchjob.tokenize.batched import load_prompts

    n = 50_000
    pq.write_table(_shared_rows(20, 0), tmp_path / "warm.parquet")
    pq.write_table(_shared_rows(n, 1), tmp_path / "big.parquet", row_group_size=8192)

    def plan_of(name: str):
        sets = {"input.path": str(tmp_path / name), "output.path": str(tmp_path / "out")}
        job = load_job(None, sets | {"input.batch_rows": "4096"})
        data, _ = load_prompts(job.input, job.model, job.sampling, "native")
        return data, build_plan(data.prompts)

    plan_of("warm.parquet")  # imports and caches first: only the rows' cost is measured
    tracemalloc.start()
    try:
        kept = plan_of("big.parquet")
        blocks = sum(s.count for s in tracemalloc.take_snapshot().statistics("filename"))
    finally:
        tracemalloc.stop()
    assert len(kept[0].prompts) == n and kept[1].num_groups > 0
    assert blocks < n // 20, f"{blocks} live allocations for {n} rows"
