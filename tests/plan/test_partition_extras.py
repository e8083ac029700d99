"""Rows that carry per-row settings and LoRA adapters through a partition spill: keyed by
(adapter, leading tokens), their settings and adapter indices read back with them, through a
re-split too; a partition's requests (samples) at the in-memory request positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from batchjob.inputs.row_settings import RowSettings, concat_settings, settings_of_rows
from batchjob.plan.partition import ROW, PartitionSpill, Rows, prefix_keys, with_adapter
from batchjob.plan.streamed import fit_partitions
from batchjob.tokenize.prompts import TokenizedPrompts

N = 3000


def _rows() -> Rows:
    rng = np.random.default_rng(1)
    heads = rng.integers(0, 50, (6, 12))  # 6 long shared heads: deeper keys needed
    seqs = [np.r_[heads[i % 6], rng.integers(0, 50, 3 + i % 5)] for i in range(N)]
    p = TokenizedPrompts.from_lists(seqs, max_tokens=4)
    ids = np.arange(N, dtype=np.int64) * 2 + 5
    temp = np.where(np.arange(N) % 3 == 0, np.nan, np.arange(N) / N)
    stop = tuple(None if i % 4 else (f"s{i}",) for i in range(N))
    settings = RowSettings(row_ids=ids, temperature=temp, stop=stop, n=np.arange(N) % 3 + 1)
    rows = np.zeros(N, dtype=ROW)
    rows["row_id"] = ids
    rows["length"] = p.lengths
    rows["max_tokens"] = 4
    counts = settings.n
    rows["position"] = np.cumsum(counts) - counts  # requests before the row
    adapter = (np.arange(N) % 3 - 1).astype(np.int32)  # -1 (base), 0, 1
    return Rows(rows, p.tokens, settings, adapter)


def _spill(rows: Rows, folder: Path, parts: int) -> PartitionSpill:
    spill = PartitionSpill(folder, parts)
    for s in range(0, N, 700):
        spill.add(rows.take(np.arange(s, min(s + 700, N))))
    return spill


def _same(a: RowSettings, b: RowSettings) -> None:
    assert np.array_equal(a.row_ids, b.row_ids)
    assert np.array_equal(a.temperature, b.temperature, equal_nan=True)
    assert a.stop == b.stop
    assert np.array_equal(a.n, b.n)


def test_adapter_keys_split_equal_tokens_and_keep_the_base_models() -> None:
    p = TokenizedPrompts.from_lists([[1, 2, 3, 4, 5]] * 3)
    keys = prefix_keys(p.tokens, p.offsets, (4,))
    salted = with_adapter(keys, np.array([-1, 0, 1]))
    assert salted[0, 0] == keys[0, 0]  # the base model: the token key itself
    assert len(set(salted[0].tolist())) == 3


def test_settings_and_adapters_come_back_with_their_rows(tmp_path: Path) -> None:
    rows = _rows()
    spill = _spill(rows, tmp_path / "s", 5)
    # a budget that forces re-splits: the extras go through PartitionSpill.chunks
    todo, depths, _ = fit_partitions(spill, 40_000, tmp_path / "s")
    assert max(depths) > 4 and len(todo) > 5
    back = [s.read(p) for s, p in todo]
    for r in back:
        assert r.settings is not None and r.adapter is not None
        assert np.array_equal(r.settings.row_ids, r.rows["row_id"])  # exactly its rows
        at = np.searchsorted(rows.rows["row_id"], r.rows["row_id"])
        assert np.array_equal(r.adapter, rows.adapter[at])
        _same(r.settings, settings_of_rows(rows.settings, r.rows["row_id"]))
    ids = np.concatenate([r.rows["row_id"] for r in back])
    assert np.array_equal(np.sort(ids), rows.rows["row_id"])
    joined = concat_settings([r.settings for r in sorted(back, key=lambda r: r.rows["row_id"][0])])
    assert len(joined.row_ids) == N


def test_requests_are_each_rows_samples_at_the_in_memory_positions(tmp_path: Path) -> None:
    rows = _rows()
    spill = _spill(rows, tmp_path / "s", 3)
    seen = []
    for p in range(3):
        part = spill.read(p)
        prompts, pos = part.requests((1, True))  # input.n_column: each row's n
        at = np.searchsorted(rows.rows["row_id"], prompts.row_ids)
        assert len(prompts) == int(part.settings.n.sum())
        assert np.array_equal(pos, rows.rows["position"][at] + prompts.sample_index)
        seen.append(pos)
    pos = np.sort(np.concatenate(seen))
    assert np.array_equal(pos, np.arange(int(rows.settings.n.sum())))  # each request once
