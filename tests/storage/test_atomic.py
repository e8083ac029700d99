"""storage.atomic: whole file or the old one, no temp left behind, mode follows the umask."""

from __future__ import annotations

import json
import os

import matplotlib
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.storage import atomic
from batchjob.storage.atomic import (
    atomic_open,
    save_figure_atomic,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
    write_text_atomic,
)

matplotlib.use("Agg")


def names(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_each_writer_round_trips_and_creates_the_folder(tmp_path):
    import matplotlib.pyplot as plt

    d = tmp_path / "a" / "b"
    write_bytes_atomic(b"\x00\x01", d / "x.bin")
    write_text_atomic("héllo\n", d / "x.txt")
    write_json_atomic({"k": [1, 2]}, d / "x.json")
    write_parquet_atomic(pa.table({"v": [1, 2, 3]}), d / "x.parquet", compression="zstd")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure_atomic(fig, d / "x.png", dpi=50)
    plt.close(fig)
    assert (d / "x.bin").read_bytes() == b"\x00\x01"
    assert (d / "x.txt").read_text(encoding="utf-8") == "héllo\n"
    assert json.loads((d / "x.json").read_text()) == {"k": [1, 2]}
    assert pq.read_table(d / "x.parquet")["v"].to_pylist() == [1, 2, 3]
    assert (d / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert names(d) == ["x.bin", "x.json", "x.parquet", "x.png", "x.txt"]


def test_table_failing_midway_leaves_old_file_and_no_temp(tmp_path):
    path = tmp_path / "t.parquet"
    write_parquet_atomic(pa.table({"v": [1]}), path)
    # the schema is written, then the unknown compression codec fails the row group
    with pytest.raises((pa.ArrowException, ValueError)):
        write_parquet_atomic(pa.table({"v": [2]}), path, compression="no-such-codec")
    assert pq.read_table(path)["v"].to_pylist() == [1]
    assert names(tmp_path) == ["t.parquet"]


def test_exception_inside_the_block_publishes_nothing(tmp_path):
    path = tmp_path / "x.txt"
    with pytest.raises(RuntimeError), atomic_open(path, "w") as f:
        f.write("partial")
        raise RuntimeError("boom")
    assert names(tmp_path) == []


def test_keyboard_interrupt_at_rename_keeps_target_and_removes_temp(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json_atomic({"v": 1}, path)

    def interrupted(src, dst):  # fault injection: Ctrl-C arrives at the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic({"v": 2}, path)
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": 1}
    assert names(tmp_path) == ["r.json"]


def test_unserialisable_json_makes_no_file(tmp_path):
    with pytest.raises(TypeError):
        write_json_atomic({"x": object()}, tmp_path / "x.json")
    assert names(tmp_path) == []


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077, 0o002])
def test_mode_follows_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert atomic.current_umask() == mask
        write_bytes_atomic(b"x", tmp_path / "f")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o666 & ~mask


def test_overwrite_takes_the_umask_not_the_old_mode(tmp_path, umask_027):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    path.chmod(0o600)
    write_bytes_atomic(b"new", path)
    assert path.read_bytes() == b"new"
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        atomic_open(tmp_path / "x", "a")


def test_write_parquet_atomic_overwrites_and_survives_a_non_table(tmp_path) -> None:
    """(moved from tests/inputs/test_io.py)"""
    p = tmp_path / "sub" / "out.parquet"
    write_parquet_atomic(pa.table({"a": [1, 2]}), p)
    assert pq.read_table(p)["a"].to_pylist() == [1, 2]
    write_parquet_atomic(pa.table({"a": [3]}), p)
    assert pq.read_table(p)["a"].to_pylist() == [3]

    class Boom:  # a failing write leaves the previous file and no temp file
        schema = None

    with pytest.raises(Exception):  # noqa: B017 - whatever pyarrow raises
        write_parquet_atomic(Boom(), p)  # type: ignore[arg-type]
    assert pq.read_table(p)["a"].to_pylist() == [3]
    assert names(p.parent) == ["out.parquet"]
