from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchjob.config import InputConfig
from batchjob.errors import InputDataError
from batchjob.inputs.parquet import (
    ROW_ID,
    PassthroughCollector,
    RejectedRows,
    open_dataset,
    resolve_files,
)
from tests.conftest import write_parquet


def ids_table(start: int, n: int) -> pa.Table:
    """n rows whose prompt encodes their global index, so row ids can be checked."""
    return pa.table(
        {
            "key": pa.array([f"k{start + i}" for i in range(n)]),
            "prompt": pa.array([[start + i, 7] for i in range(n)], pa.list_(pa.int32())),
            "max_tokens": pa.array([i % 5 + 1 for i in range(n)], pa.int16()),
        }
    )


def make_dir(tmp_path: Path, sizes: list[int]) -> Path:
    d = tmp_path / "ds"
    start = 0
    for i, n in enumerate(sizes):
        # names chosen so that sorted order differs from creation order
        write_parquet(ids_table(start, n), d / f"part-{i:03d}.parquet")
        start += n
    (d / "_SUCCESS").write_text("")  # Spark marker: not data
    (d / "README.txt").write_text("not parquet")
    return d


def cfg(path: Path | str, **kw) -> InputConfig:
    return InputConfig(path=str(path), **kw)


def collect(dataset) -> tuple[list, np.ndarray, list[int]]:
    batches = list(dataset.batches())
    ids = np.concatenate([b.row_ids for b in batches])
    first = [int(v[0]) for b in batches for v in b.prompts.to_pylist()]
    return batches, ids, first


def test_directory_streams_in_small_batches_with_stable_row_ids(tmp_path: Path) -> None:
    d = make_dir(tmp_path, [7, 0, 11, 3])
    ds = open_dataset(cfg(d, batch_rows=4))
    assert [os.path.basename(f) for f in ds.files] == [f"part-{i:03d}.parquet" for i in range(4)]
    assert ds.num_rows == 21 and not ds.prompt_is_text and ds.max_tokens_column == "max_tokens"
    batches, ids, first = collect(ds)
    assert all(len(b) <= 4 for b in batches) and len(batches) == 2 + 3 + 1
    assert ids.tolist() == list(range(21)) == first
    for b in batches:  # each batch comes from one file; locations name it
        assert b.passthrough.column(ROW_ID).to_pylist() == b.row_ids.tolist()
        assert b.passthrough.column("key").to_pylist() == [f"k{i}" for i in b.row_ids]
        assert "prompt" not in b.passthrough.column_names
        assert b.max_tokens.tolist() == [int(v) for v in b.passthrough["max_tokens"].to_pylist()]
        assert os.path.basename(b.source) in b.where(0)
    # a second run gives the same ids
    _, ids2, _ = collect(open_dataset(cfg(d, batch_rows=5)))
    assert ids2.tolist() == ids.tolist()
    col = PassthroughCollector()
    for b in batches:
        col.add(b)
    t = col.table()
    assert t.column(ROW_ID).to_pylist() == list(range(21))
    assert t.column("key").to_pylist() == [f"k{i}" for i in range(21)]


def test_glob_single_file_and_limit(tmp_path: Path) -> None:
    d = make_dir(tmp_path, [5, 6])
    ds = open_dataset(cfg(str(d / "part-*.parquet"), batch_rows=100))
    assert len(ds.files) == 2
    assert collect(ds)[1].tolist() == list(range(11))
    one = open_dataset(cfg(d / "part-001.parquet"))
    assert collect(one)[2] == list(range(5, 11))  # its own data, ids restart at 0
    assert collect(one)[1].tolist() == list(range(6))
    lim = open_dataset(cfg(d, batch_rows=2, limit=7))
    assert lim.num_rows == 7
    assert collect(lim)[1].tolist() == list(range(7))
    assert resolve_files(str(tmp_path / "ds")) == resolve_files(str(tmp_path / "d*"))


def test_text_column_and_row_id_input_column_kept(tmp_path: Path) -> None:
    t = pa.table({"row_id": [10, 11], "prompt": pa.array(["a b", "c"], pa.large_string())})
    p = write_parquet(t, tmp_path / "t.parquet")
    ds = open_dataset(cfg(p))
    assert ds.prompt_is_text and ds.max_tokens_column is None
    (b,) = ds.batches()
    assert b.max_tokens is None
    assert b.passthrough.column_names == [ROW_ID, "input_row_id"]
    assert b.passthrough["input_row_id"].to_pylist() == [10, 11]


def test_no_match(tmp_path: Path) -> None:
    with pytest.raises(InputDataError, match="matches no Parquet file"):
        open_dataset(cfg(tmp_path / "missing.parquet"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(InputDataError, match="empty_dir"):
        open_dataset(cfg(tmp_path / "empty_dir"))
    with pytest.raises(InputDataError, match="matches no Parquet file"):
        open_dataset(cfg(tmp_path / "*.parquet"))


def test_missing_prompt_column_lists_columns(tmp_path: Path) -> None:
    p = write_parquet(pa.table({"question": ["a"], "n": [1]}), tmp_path / "q.parquet")
    with pytest.raises(InputDataError) as ei:
        open_dataset(cfg(p))
    msg = str(ei.value)
    assert "q.parquet" in msg and "'prompt'" in msg and "question, n" in msg


def test_missing_id_column(tmp_path: Path) -> None:
    p = write_parquet(pa.table({"prompt": ["a"]}), tmp_path / "a.parquet")
    with pytest.raises(InputDataError, match=r"a\.parquet.*'doc'.*input\.id_column"):
        open_dataset(cfg(p, id_column="doc"))


@pytest.mark.parametrize(
    "col",
    [pa.array([1, 2]), pa.array([[1.0], [2.0]]), pa.array([["a"], ["b"]]), pa.array([b"x", b"y"])],
)
def test_wrong_prompt_type(tmp_path: Path, col: pa.Array) -> None:
    p = write_parquet(pa.table({"prompt": col}), tmp_path / "bad.parquet")
    with pytest.raises(InputDataError) as ei:
        open_dataset(cfg(p))
    msg = str(ei.value)
    assert "bad.parquet" in msg and "'prompt'" in msg and "has type" in msg


def test_non_integer_max_tokens(tmp_path: Path) -> None:
    t = pa.table({"prompt": ["a"], "max_tokens": [1.5]})
    p = write_parquet(t, tmp_path / "m.parquet")
    with pytest.raises(InputDataError, match=r"m\.parquet.*'max_tokens'.*double"):
        open_dataset(cfg(p))


def test_mixed_files(tmp_path: Path) -> None:
    write_parquet(pa.table({"prompt": ["a"]}), tmp_path / "d" / "a.parquet")
    write_parquet(pa.table({"prompt": [[1]]}), tmp_path / "d" / "b.parquet")
    with pytest.raises(InputDataError, match="text in some files"):
        open_dataset(cfg(tmp_path / "d"))


def test_corrupt_and_non_parquet_files(tmp_path: Path) -> None:
    good = write_parquet(ids_table(0, 3), tmp_path / "d" / "a.parquet")
    bad = tmp_path / "d" / "b.parquet"
    bad.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(InputDataError) as ei:
        open_dataset(cfg(tmp_path / "d"))
    assert "b.parquet" in str(ei.value) and "a.parquet" not in str(ei.value)
    # a valid footer with damaged pages: reported when the data is read, naming the file
    data = bytearray(good.read_bytes())
    data[4:60] = bytes(56)
    trunc = tmp_path / "e" / "c.parquet"
    trunc.parent.mkdir()
    trunc.write_bytes(bytes(data))
    with pytest.raises(InputDataError, match=r"c\.parquet"):
        list(open_dataset(cfg(trunc)).batches())


def test_empty_dataset(tmp_path: Path) -> None:
    t = pa.table({"prompt": pa.array([], pa.string())})
    write_parquet(t, tmp_path / "d" / "a.parquet")
    write_parquet(t, tmp_path / "d" / "b.parquet")
    with pytest.raises(InputDataError, match="0 rows"):
        open_dataset(cfg(tmp_path / "d"))


def test_rejected_rows_concat_sorted() -> None:
    a = RejectedRows(np.array([5, 1]), ("x", "y"), ("m5", "m1"))
    b = RejectedRows(np.array([3]), ("z",), ("m3",))
    c = RejectedRows.concat([a, RejectedRows.empty(), b])
    assert c.row_ids.tolist() == [1, 3, 5] and c.status == ("y", "z", "x")
    assert c.message == ("m1", "m3", "m5") and c.counts() == {"x": 1, "y": 1, "z": 1}
    assert c.to_arrow().column_names == [ROW_ID, "status", "message"]


# ---------------------------------------------------------------------------------------
# input defects that used to be a traceback or silently wrong


def test_files_typing_a_column_differently_is_an_input_error(tmp_path: Path) -> None:
    d = tmp_path / "mixed"
    write_parquet(pa.table({"prompt": ["a", "b"], "x": [1, 2]}), d / "a.parquet")
    write_parquet(pa.table({"prompt": ["c", "d"], "x": ["s", "t"]}), d / "b.parquet")
    with pytest.raises(InputDataError, match=r"b\.parquet.*'x'"):
        open_dataset(InputConfig(path=str(d)))


def test_misspelled_max_tokens_column_is_an_error_only_the_default_may_be_absent(
    tmp_path: Path,
) -> None:
    f = write_parquet(ids_table(0, 3), tmp_path / "a.parquet")
    with pytest.raises(InputDataError, match=r"'max_tokns'.*input.max_tokens_column"):
        open_dataset(InputConfig(path=str(f), max_tokens_column="max_tokns"))
    g = write_parquet(ids_table(0, 3).drop_columns(["max_tokens"]), tmp_path / "b.parquet")
    assert open_dataset(InputConfig(path=str(g))).max_tokens_column is None  # default: optional


def test_dictionary_encoded_prompt_column_is_text(tmp_path: Path) -> None:
    words = pa.array(["one two", "three", "one two", None]).dictionary_encode()
    f = write_parquet(pa.table({"prompt": words}), tmp_path / "cat.parquet")
    ds_ = open_dataset(InputConfig(path=str(f)))
    assert ds_.prompt_is_text
    batch = next(ds_.batches())
    assert batch.prompts.to_pylist() == ["one two", "three", "one two", None]
    assert pa.types.is_string(batch.prompts.type)


def test_a_link_loop_in_the_input_folder_lists_each_file_once(tmp_path: Path) -> None:
    """``ln -s . loop`` in the folder read every file again at each level (20 rows: 820)."""
    d = make_dir(tmp_path, [3, 4])
    (d / "loop").symlink_to(".")
    (d / "sub").mkdir()
    write_parquet(ids_table(7, 2), d / "sub" / "c.parquet")
    (d / "sub" / "up").symlink_to("..")  # a loop through a parent
    (d / "alias").symlink_to("sub")  # a second way into sub: its file still once
    (d / "same.parquet").symlink_to(d / "part-000.parquet")  # a link to a listed file
    want = [str(d / "part-000.parquet"), str(d / "part-001.parquet"), str(d / "sub/c.parquet")]
    assert resolve_files(str(d)) == want
    assert resolve_files(str(d / "**" / "*.parquet")) == want  # a ** glob: the same walk
    assert resolve_files(str(tmp_path / "d*")) == want
    assert open_dataset(cfg(d)).num_rows == 9


def test_duplicate_or_null_ids_are_refused_naming_the_first(tmp_path: Path) -> None:
    """Resume and exactly-once are keyed by the row: repeated or null ids ran with exit 0."""
    d = tmp_path / "ids"
    write_parquet(pa.table({"prompt": ["a", "b"], "doc": ["x", "y"]}), d / "a.parquet")
    write_parquet(pa.table({"prompt": ["c", "d", "e"], "doc": ["z", "y", "x"]}), d / "b.parquet")
    with pytest.raises(InputDataError) as e:
        open_dataset(cfg(d, id_column="doc"))
    msg = str(e.value)
    assert "row 3 (file b.parquet, row 1)" in msg and "'y'" in msg and "row 1" in msg
    assert e.value.exit_code == 4
    assert open_dataset(cfg(d, id_column="doc", limit=3)).num_rows == 3  # past the limit: unread
    write_parquet(pa.table({"prompt": ["f"], "doc": pa.array([None], pa.string())}), d / "c.pq")
    (d / "c.pq").rename(d / "c.parquet")
    assert open_dataset(cfg(d / "b.parquet", id_column="doc")).num_rows == 3
    nulls = cfg(d / "[bc].parquet", id_column="doc")
    with pytest.raises(InputDataError, match=r"row 3 \(file c\.parquet, row 0\).*'doc' is null"):
        open_dataset(nulls)
