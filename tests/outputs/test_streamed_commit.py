"""The streamed commit without a model: results files equal to the in-memory commit's, and a
row missing or written twice stops it before anything is committed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import OutputConfig
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.results import ResultRow, ResultSink
from batchjob.outputs.streamed_commit import ResultStarts, RowBits, bucket_parts, done_rows

MANIFEST = {"fingerprint": {"input.files": [["in.parquet", 1, "sha256:x"]]}, "job": {}}
N = 23


def _sink(tmp_path, name: str, ids, rows_per_file: int = 5) -> ResultSink:
    layout = OutputLayout.of(OutputConfig(path=tmp_path / name, rows_per_file=rows_per_file))
    layout.prepare()
    sink = ResultSink(layout, MANIFEST, flush_rows=4, rows_per_file=rows_per_file)
    for i in ids:
        sink.add(ResultRow(int(i), f"t{i}", np.array([i, 1], np.int32), 3, 2, "stop", "ok", None))
    sink.flush()
    return sink


def _passthrough(lo: int, hi: int) -> pa.Table:
    ids = np.arange(lo, hi, dtype=np.int64)
    return pa.table({"row_id": ids, "doc": pa.array([f"d{i}" for i in ids])})


def test_streamed_files_equal_the_in_memory_commit(tmp_path) -> None:
    ids = np.random.default_rng(1).permutation(N)
    ref = _sink(tmp_path, "ref", ids)
    ref.finalize(_passthrough(0, N), expected_rows=N)
    sink = _sink(tmp_path, "streamed", ids)
    assert done_rows(sink.layout, N).count() == N
    buckets = tmp_path / "buckets"
    buckets.mkdir()
    streamed = bucket_parts(sink.layout, sink.schema, buckets, N, sink.rows_per_file)
    batches = [_passthrough(lo, min(lo + 7, N)) for lo in range(0, N, 7)]  # not file-aligned
    sink.commit_chunks(streamed.chunks(iter(batches), batches[0].schema), N)
    a = sorted((tmp_path / "ref").glob("results-*.parquet"))
    b = sorted((tmp_path / "streamed").glob("results-*.parquet"))
    assert len(a) == len(b) == 5
    for x, y in zip(a, b, strict=True):
        assert pq.read_table(x).equals(pq.read_table(y))


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([*range(N), 4], "row 4 is in the parts twice"),
        (range(N - 1), "results hold 22 rows for 23 expected"),
        ([*range(N - 1), N], "results hold row 23 of 23 rows"),
    ],
)
def test_a_row_missing_or_twice_commits_nothing(tmp_path, ids, match) -> None:
    sink = _sink(tmp_path, "out", ids)
    buckets = tmp_path / "buckets"
    buckets.mkdir()
    with pytest.raises(RuntimeError, match=match):
        bucket_parts(sink.layout, sink.schema, buckets, N, sink.rows_per_file)
    assert not (tmp_path / "out").exists() and sink.layout.has_parts()


def test_row_bits() -> None:
    bits = RowBits(20)
    bits.add(np.array([0, 7, 8, 19]))
    assert bits.has(np.arange(20)).nonzero()[0].tolist() == [0, 7, 8, 19]
    assert bits.count() == 4


def _sample_sink(tmp_path, name: str, keys, rows_per_file: int = 5) -> ResultSink:
    layout = OutputLayout.of(OutputConfig(path=tmp_path / name, rows_per_file=rows_per_file))
    layout.prepare()
    sink = ResultSink(
        layout, MANIFEST, flush_rows=4, rows_per_file=rows_per_file, extra_columns=("sample_index",)
    )
    for r, k in keys:
        row = ResultRow(int(r), f"t{r}.{k}", np.array([r, k], np.int32), 3, 2, "stop", "ok", None)
        sink.add(dataclasses.replace(row, sample_index=None if k < 0 else int(k)))
    sink.flush()
    return sink


def test_samples_commit_equals_the_in_memory_commit_files_splitting_a_row(tmp_path) -> None:
    """Rows of 0..3 results (a rejected row: one, no sample index): the result index of each
    (row, sample) from ``ResultStarts``; a row's samples may span two files."""
    counts = np.array([3, 1, 2, 3, 1, 3, 2, 2, 1, 3, 3], np.int64)
    rejected = {1, 8}  # one result each, sample_index null
    keys = [(r, -1 if r in rejected else k) for r in range(len(counts)) for k in range(counts[r])]
    keys = [keys[i] for i in np.random.default_rng(2).permutation(len(keys))]
    total = int(counts.sum())
    ref = _sample_sink(tmp_path, "ref", keys)
    ref.finalize(_passthrough(0, len(counts)), expected_rows=total)
    starts = ResultStarts(tmp_path / "starts")
    starts.add(counts[:4])
    starts.add(counts[4:])
    index = starts.index()
    assert index.num_results == total and index.rows_of(4, 9) == (2, 4)
    assert index.valid(np.array([0, 0, 1, 11]), np.array([2, 3, 0, 0])).tolist() == [
        True,
        False,
        True,
        False,
    ]
    sink = _sample_sink(tmp_path, "streamed", keys)
    assert done_rows(sink.layout, len(counts), index).count() == total
    buckets = tmp_path / "buckets"
    buckets.mkdir()
    streamed = bucket_parts(sink.layout, sink.schema, buckets, len(counts), 5, index)
    batches = [_passthrough(lo, min(lo + 4, len(counts))) for lo in range(0, len(counts), 4)]
    sink.commit_chunks(streamed.chunks(iter(batches), batches[0].schema), total)
    a = sorted((tmp_path / "ref").glob("results-*.parquet"))
    b = sorted((tmp_path / "streamed").glob("results-*.parquet"))
    assert len(a) == len(b) == -(-total // 5)
    for x, y in zip(a, b, strict=True):
        assert pq.read_table(x).equals(pq.read_table(y))
