"""The commit's pieces, without a model: part names per run, a row two runs both wrote, the
folder swap and its recovery rule, what batchjob counts as its own in a results folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.config import OutputConfig
from batchjob.outputs.naming import OutputLayout
from batchjob.outputs.ownership import committed_files, foreign_entries, owned_results, swappable
from batchjob.outputs.recovery import clean_stale
from batchjob.outputs.results import ResultRow, ResultSink
from batchjob.storage.atomic import rename_exchange

MANIFEST = {"fingerprint": {"input.files": [["in.parquet", 1, "sha256:x"]]}, "job": {}}


def _layout(out: Path, **kw) -> OutputLayout:
    layout = OutputLayout.of(OutputConfig(path=out, **kw))
    layout.prepare()
    return layout


def _row(i: int, text: str = "x") -> ResultRow:
    return ResultRow(i, text, np.array([1, 2], np.int32), 3, 2, "stop", "ok", None)


def _write(layout: OutputLayout, run: str, ids: list[int], writer: str = "") -> ResultSink:
    sink = ResultSink(layout, MANIFEST, flush_rows=100, rows_per_file=2, run=run, writer=writer)
    for i in ids:
        sink.add(_row(i, run))
    sink.flush()
    return sink


def _passthrough(n: int) -> pa.Table:
    return pa.table({"row_id": pa.array(range(n), pa.int64())})


def test_part_names_carry_the_run_and_the_writer(tmp_path):
    layout = _layout(tmp_path / "out")
    _write(layout, "aaaaaaaa", [0, 1], writer="w0")
    _write(layout, "bbbbbbbb", [2])
    assert [p.name for p in layout.part_files()] == [
        "part-000000-aaaaaaaa-w0.parquet",
        "part-000001-bbbbbbbb.parquet",
    ]


def test_a_row_two_runs_wrote_is_kept_once_and_one_run_twice_is_a_bug(tmp_path):
    layout = _layout(tmp_path / "out")
    _write(layout, "aaaaaaaa", [0, 1], writer="w0")  # a dead run's worker: row 1 ...
    sink = _write(layout, "bbbbbbbb", [1, 2])  # ... which the next run wrote too
    sink.finalize(_passthrough(3), expected_rows=3)
    got = pq.read_table(layout.output).sort_by("row_id")
    assert got["row_id"].to_pylist() == [0, 1, 2]
    assert got["output_text"].to_pylist() == ["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"]

    other = _layout(tmp_path / "other")
    _write(other, "cccccccc", [0, 1])
    sink = _write(other, "cccccccc", [1])
    with pytest.raises(RuntimeError, match="two part files of one run"):
        sink.finalize(_passthrough(2), expected_rows=2)


def test_folder_commits_swap_whole_folders_with_new_names(tmp_path):
    out = tmp_path / "out"
    layout = _layout(out)
    sink = _write(layout, "aaaaaaaa", [0, 1, 2])
    sink.finalize(_passthrough(3), expected_rows=3)
    first = json.loads((out / "_SUCCESS").read_text())
    assert first["committer"] == "batchjob" and first["rows"] == 3 and len(first["files"]) == 2
    assert sorted(os.listdir(out)) == sorted(["_SUCCESS", *first["files"]])
    sink.cleanup()
    _write(layout, "bbbbbbbb", [0, 1]).finalize(_passthrough(2), expected_rows=2)
    second = json.loads((out / "_SUCCESS").read_text())
    assert not set(first["files"]) & set(second["files"])
    assert sorted(os.listdir(out)) == sorted(["_SUCCESS", *second["files"]])
    manifest = json.loads(layout.manifest_file.read_text())
    assert manifest["results"] == {k: second[k] for k in ("commit", "files", "rows")}
    assert [p.name for p in committed_files(out)] == second["files"]


def test_committed_files_are_only_those_batchjobs_success_lists(tmp_path):
    """A folder's committed files are the ones its batchjob ``_SUCCESS`` names: other Parquet
    files beside them are not results, and a folder with no such ``_SUCCESS`` has none."""
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(_passthrough(1), out / "results-00000.parquet")
    (out / "_SUCCESS").write_text("1 rows\n")  # not batchjob's marker
    assert committed_files(out) == []
    (out / "_SUCCESS").unlink()
    layout = _layout(out, allow_other_files=True)
    _write(layout, "aaaaaaaa", [0, 1, 2]).finalize(_passthrough(3), expected_rows=3)
    listed = json.loads((out / "_SUCCESS").read_text())["files"]
    assert [p.name for p in committed_files(out)] == listed
    assert "results-00000.parquet" not in listed


def test_a_kill_between_the_two_renames_is_put_right(tmp_path):
    """Without rename-exchange the old folder goes to <meta>/previous first: a run killed
    before the new one is in place leaves no results folder; the next run moves it back."""
    out = tmp_path / "out"
    layout = _layout(out)
    _write(layout, "aaaaaaaa", [0, 1]).finalize(_passthrough(2), expected_rows=2)
    before = sorted(os.listdir(out))
    out.rename(layout.previous)  # where the kill left it
    clean_stale(layout)
    assert sorted(os.listdir(out)) == before and not layout.previous.exists()


def test_rename_exchange_swaps_two_folders(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    assert rename_exchange(a, b)
    assert (b / "x").read_text() == "a" and not list(a.iterdir())
    monkeypatch.setenv("BATCHJOB_RENAME_EXCHANGE", "0")
    assert not rename_exchange(a, b)  # the fallback's switch: nothing changed
    assert (b / "x").exists()


def test_only_what_batchjob_wrote_is_its_own(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("notes.txt", "results-00007.parquet", "report.json", ".hidden.tmp"):
        (out / name).write_text("user")
    layout = _layout(out, allow_other_files=True)
    assert foreign_entries(layout) == sorted(os.listdir(out))
    assert not swappable(layout)
    _write(layout, "aaaaaaaa", [0, 1, 2]).finalize(_passthrough(3), expected_rows=3)
    ours = json.loads((out / "_SUCCESS").read_text())["files"]
    assert owned_results(layout) == {"_SUCCESS", *ours}
    assert sorted(foreign_entries(layout)) == [
        ".hidden.tmp",
        "notes.txt",
        "report.json",
        "results-00007.parquet",
    ]
    assert all((out / n).read_text() == "user" for n in foreign_entries(layout))
