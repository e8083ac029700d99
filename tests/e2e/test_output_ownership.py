"""A run owns exactly its results path and its metadata folder, and nothing else.

- a folder that holds files batchjob did not write is refused (exit 3) and left as it was;
  with ``output.allow_other_files`` the results go beside those files, which no run deletes;
- an empty output path, a path ending in ``.meta`` and a path inside another output's results
  or metadata folder are refused before any work;
- a file output and a folder output of the same stem have their own metadata folders (and
  do not both write one OpenAI Batch file);
- ``out/res.meta/`` is the folder output ``out/res``'s: a run of ``out/res.parquet`` never
  reads, moves or resumes it, whatever its manifest names;
- a job's input is identified by its bytes: rewritten with the same size and mtime, it is
  another job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import EXIT_CONFIG, EXIT_RUNTIME
from tests.e2e.jobkit import cli, read_results, write_job


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes (what must stay as it was)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _user_folder(folder: Path) -> dict[str, bytes]:
    """A folder of someone's files, some named as batchjob names its own."""
    (folder / "_parts").mkdir(parents=True)
    for name in ("report.json", "plan.parquet", "results-00007.parquet", "notes.txt"):
        (folder / name).write_text(f"the user's {name}")
    (folder / "_parts" / "keep.txt").write_text("keep")
    return _tree(folder)


def _rows(path: Path) -> pa.Table:
    from batchjob.outputs.ownership import committed_files

    return pa.concat_tables([pq.read_table(f) for f in committed_files(path)]).sort_by("row_id")


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path, run_model, run_data):
    out = tmp_path / "mine"
    before = _user_folder(out)
    res = cli("run", write_job(tmp_path, run_model, run_data, out))
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "output.allow_other_files" in res.stderr and "notes.txt" in res.stderr
    assert _tree(out) == before


def test_allow_other_files_writes_beside_them_and_never_deletes_them(tmp_path, run_model, run_data):
    out = tmp_path / "mine"
    before = _user_folder(out)
    job = write_job(tmp_path, run_model, run_data, out, allow_other_files="true")
    assert cli("run", job).exit_code == 0
    n = pq.read_metadata(run_data).num_rows
    assert _rows(out)["row_id"].to_pylist() == list(range(n))
    res = cli("run", job, "--set", "output.overwrite=true", "--set", "input.limit=5")
    assert res.exit_code == 0, res.output
    assert _rows(out)["row_id"].to_pylist() == list(range(5))
    after = _tree(out)
    assert {k: v for k, v in after.items() if k in before} == before  # every file untouched
    ours = sorted(k for k in after if k not in before)
    assert ours[0] == "_SUCCESS" and len(ours) == 2 and ours[1].startswith("results-00000-")


def test_a_foreign_success_marker_is_refused_even_when_others_are_allowed(
    tmp_path, run_model, run_data
):
    out = tmp_path / "spark"
    out.mkdir()
    (out / "_SUCCESS").write_text("")
    (out / "part-0.parquet").write_bytes(run_data.read_bytes())
    before = _tree(out)
    job = write_job(tmp_path, run_model, run_data, out, allow_other_files="true")
    res = cli("run", job)
    assert res.exit_code == EXIT_CONFIG and "_SUCCESS" in res.stderr, res.output
    assert _tree(out) == before


def test_empty_output_path_is_refused(tmp_path, run_model, run_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.json").write_text("keep")
    args = ["--input", str(run_data), "--model", str(run_model), "--set", "model.device=cpu"]
    for out in (["--output", ""], ["--set", "output.path="], ["--set", "output.path=  "]):
        res = cli("run", *args, *out)
        assert res.exit_code == EXIT_CONFIG and "output.path" in res.stderr, (out, res.output)
    job = tmp_path / "job.toml"
    job.write_text(f'[input]\npath = "{run_data}"\n[output]\npath = ""\n')
    assert cli("run", job).exit_code == EXIT_CONFIG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml", "report.json"]


def test_an_output_named_like_a_metadata_folder_is_refused(tmp_path, run_model, run_data):
    first = write_job(tmp_path, run_model, run_data, "out/a")
    assert cli("run", first).exit_code == 0
    meta = tmp_path / "out" / "a.meta"
    before = _tree(meta)
    res = cli("run", write_job(tmp_path, run_model, run_data, meta, overwrite="true"))
    assert res.exit_code == EXIT_CONFIG and ".meta" in res.stderr, res.output
    assert _tree(meta) == before
    again = cli("run", first)
    assert again.exit_code == 0 and "already complete" in again.output


@pytest.mark.parametrize("inside", ["a/b.parquet", "a/sub", "a.meta/b.parquet"])
def test_an_output_inside_another_output_is_refused(tmp_path, run_model, run_data, inside):
    assert cli("run", write_job(tmp_path, run_model, run_data, "out/a")).exit_code == 0
    before = _tree(tmp_path / "out")
    res = cli("run", write_job(tmp_path, run_model, run_data, tmp_path / "out" / inside))
    assert res.exit_code == EXIT_CONFIG and "inside" in res.stderr, res.output
    assert _tree(tmp_path / "out") == before


def test_file_and_folder_outputs_of_one_stem_have_their_own_metadata(tmp_path, run_model, run_data):
    a = write_job(tmp_path, run_model, run_data, "x/res.parquet")
    assert cli("run", a).exit_code == 0
    a_meta = tmp_path / "x" / "res.parquet.meta"
    a_manifest = (a_meta / "manifest.json").read_bytes()
    b = write_job(tmp_path, run_model, run_data, "x/res", overwrite="false")
    res = cli("run", b, "--set", "sampling.temperature=0.5")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "x" / "res.meta" / "manifest.json").is_file()
    assert (a_meta / "manifest.json").read_bytes() == a_manifest  # A's, untouched
    again = cli("run", a)
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    assert (tmp_path / "x" / "res.parquet").is_file() and (tmp_path / "x" / "res").is_dir()


def test_one_openai_batch_file_is_not_written_by_two_outputs(tmp_path, run_model, run_data):
    """``out/res.parquet`` and ``out/res`` would both write ``out/res.jsonl``."""
    a = write_job(tmp_path, run_model, run_data, "x/res.parquet", format='"openai-jsonl"')
    assert cli("run", a).exit_code == 0
    lines = (tmp_path / "x" / "res.jsonl").read_bytes()
    b = write_job(tmp_path, run_model, run_data, "x/res", format='"openai-jsonl"')
    res = cli("run", b)
    assert res.exit_code == EXIT_CONFIG and "res.jsonl" in res.stderr, res.output
    assert (tmp_path / "x" / "res.jsonl").read_bytes() == lines


def test_a_meta_folder_of_the_stem_is_not_the_file_outputs(tmp_path, run_model, run_data):
    """``out/res.meta/`` names the metadata of the folder output ``out/res``: even holding a
    manifest of ``out/res.parquet``, the file output's run leaves it as it is and computes
    its rows afresh in ``out/res.parquet.meta/``."""
    job = write_job(tmp_path, run_model, run_data, "out/res.parquet")
    assert cli("run", job).exit_code == 0
    new, old = tmp_path / "out" / "res.parquet.meta", tmp_path / "out" / "res.meta"
    new.rename(old)
    (tmp_path / "out" / "res.parquet").unlink()
    before = _tree(old)
    res = cli("run", job, "--json")
    assert res.exit_code == 0, res.output
    n = pq.read_metadata(run_data).num_rows
    assert json.loads(res.stdout)["rows_skipped_done"] == 0
    assert _tree(old) == before and (new / "manifest.json").is_file()
    assert read_results(tmp_path / "out" / "res.parquet")["row_id"].to_pylist() == list(range(n))


# ---------------------------------------------------------------------------------------
# the input is identified by its bytes


def _same_size_rewrite(path: Path, table: pa.Table) -> None:
    """Write ``table`` at ``path`` byte for byte as large as before, with the old mtime."""
    st = path.stat()
    pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False)
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_input_rewritten_at_the_same_size_and_mtime_is_another_job(
    tmp_path, run_model, run_data, monkeypatch
):
    data = tmp_path / "in.parquet"
    table = pq.read_table(run_data).select(["prompt", "request_id"])
    pq.write_table(table, data, compression="none", use_dictionary=False, write_statistics=False)
    job = write_job(tmp_path, run_model, data, "out/res.parquet", flush_rows="4")
    monkeypatch.setenv("BATCHJOB_FAULT_POINT", "part:3:ENOSPC")
    assert cli("run", job).exit_code == EXIT_RUNTIME  # rows written, then a failure
    monkeypatch.delenv("BATCHJOB_FAULT_POINT")
    rows = table.to_pylist()
    _same_size_rewrite(data, pa.Table.from_pylist(rows[::-1], schema=table.schema))
    res = cli("run", job)
    assert res.exit_code == EXIT_CONFIG, res.output
    assert "input.files" in res.stderr and "sha256:" in res.stderr, res.stderr
    res = cli("run", job, "--set", "output.overwrite=true")
    assert res.exit_code == 0, res.output
    out = read_results(tmp_path / "out" / "res.parquet")
    assert out["request_id"].to_pylist() == [r["request_id"] for r in rows[::-1]]
