"""Structured output on ``engine.backend = "vllm"``: vLLM's own structured outputs
(``StructuredOutputsParams(json=...)``) on the tiny random-weight model; every ``ok`` row
validates against the schema with ``jsonschema``, and a tiny ``max_tokens`` gives finish
"length" with status ``json_incomplete`` (as on the native engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli import main
from tests.backends.vllm.vllm_kit import needs_vllm
from tests.e2e.test_json_schema import SCHEMA  # the same schema on both backends

pytestmark = [needs_vllm, pytest.mark.slow]
jsonschema = pytest.importorskip("jsonschema")


def write_job(tmp: Path, model: Path, data: Path, name: str, max_tokens: int) -> Path:
    schema = json.dumps(SCHEMA).replace('"', '\\"')
    job = tmp / f"{name}.toml"
    job.write_text(
        f'[input]\npath = "{data}"\nmax_tokens_column = "no_limit"\n'
        f'[model]\npath = "{model}"\n'
        f'[sampling]\nmax_tokens = {max_tokens}\njson_schema = "{schema}"\n'
        '[engine]\nbackend = "vllm"\nblock_size = 32\nkv_cache_bytes = "8MiB"\nthreads = 1\n'
        "vllm = {enforce_eager = true}\n"
        f'[output]\npath = "{tmp / name}.parquet"\n'
    )
    return job


def test_vllm_json_schema(tmp_path, model_dir, dataset):
    import pyarrow as pa

    table = pq.read_table(dataset)
    table = table.drop_columns([c for c in table.column_names if c == "max_tokens"]).slice(0, 8)
    data = tmp_path / "d.parquet"
    pq.write_table(table.append_column("no_limit", pa.array([None] * 8, pa.int32())), data)
    res = CliRunner().invoke(main, ["run", str(write_job(tmp_path, model_dir, data, "a", 64))])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(tmp_path / "a.parquet").to_pylist()
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 6, [(r["status"], r["output_text"]) for r in rows]
    for r in ok:
        jsonschema.validate(json.loads(r["output_text"]), SCHEMA)

    res = CliRunner().invoke(main, ["run", str(write_job(tmp_path, model_dir, data, "b", 3))])
    assert res.exit_code == 0, res.output
    for r in pq.read_table(tmp_path / "b.parquet").to_pylist():
        assert (r["finish_reason"], r["status"]) == ("length", "json_incomplete")


def test_vllm_json_schema_column(tmp_path, model_dir):
    """``input.json_schema_column``: the rows of tests/e2e/test_json_schema_column.py (two
    schemas, a null, three bad ones); every ok row validates against its own schema."""
    from tests.e2e.test_json_schema_column import LIST, check_rows, schema_table

    data = tmp_path / "rows.parquet"
    pq.write_table(schema_table(), data)
    job = write_job(tmp_path, model_dir, data, "col", 48)
    default = json.dumps(json.dumps(LIST))
    text = job.read_text().replace('no_limit"\n', 'max_tokens"\njson_schema_column = "schema"\n')
    job.write_text(text.replace(text.split("json_schema = ")[1].split("\n")[0], default))
    res = CliRunner().invoke(main, ["run", str(job)])
    assert res.exit_code == 0, res.output
    check_rows(pq.read_table(tmp_path / "col.parquet").to_pylist(), LIST)
