"""A partitioned run's rejected rows and iteration records, spilled as they come: the same
contents and totals as held in memory, in memory that does not grow with the rows."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pyarrow.parquet as pq

from batchjob.backends.base import BackendRun, IterationRecord
from batchjob.inputs.parquet import RejectedRows
from batchjob.outputs.report import iterations_table, summarize
from batchjob.outputs.spilled_records import IterationLog, RejectedSpill


def _rejected(start: int, n: int, rng: np.random.Generator) -> RejectedRows:
    ids = np.sort(rng.choice(np.arange(start, start + 4 * n), size=n, replace=False))
    status = tuple(rng.choice(["empty_prompt", "prompt_too_long", "invalid_token"], size=n))
    return RejectedRows(ids, status, tuple(f"row {i}: rejected in file x.parquet" for i in ids))


def test_rejected_spill_equals_the_rows_held_in_memory(tmp_path) -> None:
    rng = np.random.default_rng(0)
    parts = [_rejected(k * 4000, int(rng.integers(0, 700)), rng) for k in range(40)]
    spill = RejectedSpill(tmp_path, batch=1000)
    for p in parts:
        spill.add(p)
    held = RejectedRows.concat(parts)
    assert len(spill) == len(held) and spill.counts() == held.counts()
    assert spill.first_message == held.message[0]
    back = RejectedRows.concat(list(spill.chunks()))  # row groups, then the buffer
    assert np.array_equal(back.row_ids, held.row_ids)
    assert back.status == held.status and back.message == held.message
    assert pq.ParquetFile(spill.path).num_row_groups > 1


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_rejected_spill_memory_does_not_grow_with_the_rows(tmp_path) -> None:
    rng = np.random.default_rng(1)
    chunk = _rejected(0, 1000, rng)

    def add(n_chunks: int, folder) -> None:
        folder.mkdir()
        spill = RejectedSpill(folder, batch=2000)
        for _ in range(n_chunks):
            spill.add(chunk)
        assert len(spill) == 1000 * n_chunks

    small = _peak(lambda: add(4, tmp_path / "a"))  # 4k rows
    large = _peak(lambda: add(40, tmp_path / "b"))  # 40k rows: ~8 MB as RejectedRows
    assert large < 1.5 * small + (1 << 20), (small, large)


def _records(n: int, rng: np.random.Generator) -> list[IterationRecord]:
    """One partition's run: iterations numbered from 0, prefill early, decode at the end."""
    pre = np.where(np.arange(n) < n - 3, rng.integers(0, 500, size=n), 0)
    return [
        IterationRecord(
            iteration=i,
            decode_tokens=int(rng.integers(0, 64)),
            prefill_tokens=int(pre[i]),
            num_seqs=int(rng.integers(1, 64)),
            kv_blocks_used=int(rng.integers(0, 900)),
            kv_bytes_used=int(rng.integers(0, 1 << 30)),
            preempted=int(rng.integers(0, 2)),
            wall_s=float(rng.random()),
        )
        for i in range(n)
    ]


def test_iteration_log_equals_the_records_held_in_memory(tmp_path) -> None:
    rng = np.random.default_rng(2)
    runs = [_records(int(rng.integers(1, 300)), rng) for _ in range(12)]
    log = IterationLog(tmp_path, batch=128)
    for r in runs:
        log.add(r)
    # held in memory, numbered on across the runs as the log numbers them
    flat = [rec for r in runs for rec in r]
    held = [dataclasses.replace(rec, iteration=i) for i, rec in enumerate(flat)]
    log.write(tmp_path / "iterations.parquet")
    got = pq.read_table(tmp_path / "iterations.parquet")
    want = iterations_table(held)
    assert got.column_names == want.column_names
    for c in want.column_names:
        assert got[c].to_pylist() == want[c].to_pylist(), c

    run = BackendRun(held, 0, 0, 0, 0, 0, 1.0)
    kw = dict(
        prompt_tokens=1,
        generated_tokens=1,
        requests_run=1,
        rows={"total": 1, "ok": 1, "rejected": 0, "skipped": 0},
        plan_ratios=(0.0, 0.0),
        total_s=1.0,
        stage_s={},
        policy="batchllm",
        device="cpu",
    )
    a = summarize(run, **kw)
    b = summarize(dataclasses.replace(run, iterations=[]), iterations=log, **kw)
    assert a.iterations == b.iterations == len(held)
    assert a.min_tokens_per_iteration == b.min_tokens_per_iteration
    assert np.isclose(a.mean_tokens_per_iteration, b.mean_tokens_per_iteration)
    assert np.isclose(a.tecd_s, b.tecd_s)
    folder = log.folder
    log.close()
    assert not folder.exists()


def test_iteration_log_memory_does_not_grow_with_the_iterations(tmp_path) -> None:
    rng = np.random.default_rng(3)
    chunk = _records(1000, rng)

    def add(n_chunks: int) -> None:
        log = IterationLog(tmp_path, batch=2000)
        try:
            for _ in range(n_chunks):
                log.add(chunk)
            assert log.count == 1000 * n_chunks
        finally:
            log.close()

    small = _peak(lambda: add(4))  # 4k records
    large = _peak(lambda: add(40))  # 40k records: ~12 MB as a list of records
    assert large < 1.5 * small + (1 << 20), (small, large)
