"""The reference of every job-file key (``batchjob keys``, docs/job_file.md), generated from the
sections; the closest key named for a misspelled one; ``--set`` into table-valued keys and
``null`` for optional ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import batchjob.config.keys as keys_mod
from batchjob.cli import main
from batchjob.config import SECTIONS, load_job
from batchjob.config.keys import keys, sync_markdown
from batchjob.config.load import closest_key
from batchjob.errors import ConfigError
from batchjob.inputs.parquet import open_dataset

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "job_file.md"
BASE = {"input.path": "in.parquet", "output.path": "out.parquet"}


def test_every_key_is_listed_with_its_meaning() -> None:
    listed = [k.dotted for k in keys()]
    declared = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert listed == declared
    missing = [k.dotted for k in keys() if not k.meaning]
    assert not missing, (
        f"keys without their meaning line (a trailing comment on the field): {missing}"
    )
    by_key = {k.dotted: k for k in keys()}
    assert by_key["sampling.max_tokens"].default == "128"
    assert by_key["sampling.top_k"].allowed == ">= 0"
    assert by_key["engine.backend"].allowed == "one of native, vllm"
    assert by_key["sampling.top_p"].allowed == "(0, 1]"
    assert by_key["input.path"].default == "required"
    assert by_key["engine.kv_cache_bytes"].type.startswith("bytes")
    assert by_key["sampling.stop"].type == "list of text"


@dataclass(frozen=True)
class _Undocumented:
    documented: int = 1  # what it means
    # what it means, said above it
    # over two lines
    above: int = 3
    forgotten: int = 2


def test_a_key_without_its_meaning_is_found(monkeypatch) -> None:
    """The check can fail: a section with a field that has no comment."""
    monkeypatch.setattr(keys_mod, "SECTIONS", {"extra": _Undocumented})
    found = {k.name: k.meaning for k in keys_mod.keys()}  # noqa: SIM118 (a function)
    assert found == {
        "documented": "what it means",
        "above": "what it means, said above it over two lines",
        "forgotten": "",
    }


def test_the_docs_tables_are_generated_from_the_sections() -> None:
    text = DOC.read_text()
    for section in SECTIONS:
        assert keys_mod.marker(section)[0] in text, f"docs/job_file.md lacks [{section}]'s table"
    assert sync_markdown(text) == text, (
        "docs/job_file.md is out of date with batchjob/config/sections.py; regenerate: "
        '.venv/bin/python -c "from pathlib import Path; from batchjob.config.keys import '
        "sync_markdown as s; p = Path('docs/job_file.md'); p.write_text(s(p.read_text()))\""
    )


def test_batchjob_keys_lists_every_key() -> None:
    r = CliRunner().invoke(main, ["keys"])
    assert r.exit_code == 0, r.output
    for k in keys():
        assert f"{k.dotted} = {k.default}" in r.output
        assert k.meaning in r.output
    one = CliRunner().invoke(main, ["keys", "sampling"])
    assert one.exit_code == 0 and "sampling.max_tokens = 128" in one.output
    assert "engine." not in one.output
    md = CliRunner().invoke(main, ["keys", "--markdown"])
    assert md.exit_code == 0 and keys_mod.marker("storage")[0] in md.output
    bad = CliRunner().invoke(main, ["keys", "sampler"])
    assert bad.exit_code == 3 and "did you mean sampling" in bad.output


@pytest.mark.parametrize(
    "section, key, want",
    [
        ("sampling", "max_token", "sampling.max_tokens"),
        ("sampling", "chunk_size", "scheduler.chunk_size"),  # another section's key
        ("engine", "kv_cache", "engine.kv_cache_bytes"),
        ("input", "prompt_col", "input.prompt_column"),
        ("sampling", "zzzz", None),
    ],
)
def test_closest_key(section: str, key: str, want: str | None) -> None:
    assert closest_key(section, key) == want


def test_misspelled_keys_name_the_closest_in_files_and_set(tmp_path: Path) -> None:
    job = tmp_path / "j.toml"
    job.write_text('[input]\npath = "x.parquet"\n[output]\npath = "o.parquet"\n')
    job.write_text(job.read_text() + "[sampling]\nmax_token = 5\n")
    with pytest.raises(ConfigError, match=r"sampling\.max_token: unknown key in .*j\.toml; "
                       r"did you mean sampling\.max_tokens\?"):  # fmt: skip
        load_job(job)
    with pytest.raises(ConfigError, match=r"did you mean engine\.block_size\?"):
        load_job(None, {**BASE, "engine.blocksize": "32"})
    with pytest.raises(
        ConfigError, match=r"unknown section \[samplng\]; did you mean \[sampling\]"
    ):
        load_job(None, {**BASE, "samplng.max_tokens": "5"})
    top = tmp_path / "top.toml"  # a key written before any section header
    top.write_text('max_tokens = 5\n[input]\npath = "x.parquet"\n')
    with pytest.raises(ConfigError, match=r"did you mean sampling\.max_tokens\?"):
        load_job(top)


def test_set_into_table_valued_keys(tmp_path: Path) -> None:
    job = tmp_path / "j.toml"
    job.write_text(
        '[input]\npath = "x.parquet"\n[output]\npath = "o.parquet"\n'
        '[engine]\nbackend = "vllm"\nvllm = {enforce_eager = true}\n'
    )
    loaded = load_job(
        job,
        {
            "engine.vllm.tensor_parallel_size": "2",
            "engine.vllm.quantization": "awq",
            "storage.options.request_timeout": "30",
        },
    )
    assert loaded.engine.vllm == {
        "enforce_eager": True,
        "tensor_parallel_size": 2,
        "quantization": "awq",
    }
    assert loaded.storage.options == {"request_timeout": 30}
    with pytest.raises(ConfigError, match=r"engine\.block_size is not a table"):
        load_job(None, {**BASE, "engine.block_size.x": "1"})
    with pytest.raises(ConfigError, match=r"did you mean engine\.vllm\?"):
        load_job(None, {**BASE, "engine.vlm.x": "1"})


def test_null_unsets_an_optional_column_key(tmp_path: Path) -> None:
    for word in ("null", "none", "None"):
        job = load_job(None, {**BASE, "input.max_tokens_column": word})
        assert job.input.max_tokens_column is None
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "max_tokens": [3]}), data)
    cfg = load_job(None, {**BASE, "input.path": str(data)}).input
    assert open_dataset(cfg).max_tokens_column == "max_tokens"
    unset = dataclasses.replace(cfg, max_tokens_column=None)
    assert open_dataset(unset).max_tokens_column is None  # the column passes through unused
    assert load_job(None, {**BASE, "input.id_column": "null"}).input.id_column is None
