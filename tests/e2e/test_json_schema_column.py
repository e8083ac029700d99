"""Per-row JSON schemas (``input.json_schema_column``) on the native engine: every ``ok`` row
validates (``jsonschema``) against its own row's schema, a null takes
``sampling.json_schema`` (unset: free text), and a bad schema rejects its row with status
``invalid_json_schema`` naming the row and column, never the job. The same data on the vLLM
backend: tests/backends/vllm/test_vllm_json_schema.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.errors import EXIT_CONFIG, EXIT_INPUT
from tests.e2e.jobkit import build_model, cli, read_results
from tests.e2e.test_json_schema import SCHEMA

jsonschema = pytest.importorskip("jsonschema")

LIST = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 99},
    "minItems": 1,
    "maxItems": 3,
}
BAD = '{"type": "no-such-type"}'
# per row: SCHEMA, LIST, null, a bad schema, not JSON, not an object
A, B = json.dumps(SCHEMA), json.dumps(LIST)
ROW_SCHEMAS = [A, B, None, BAD, "{oops", "[1, 2]", A, B]
INVALID = {3, 4, 5}


def schema_table() -> pa.Table:
    prompts = [f"review {i}: the {w} was fine and the price" for i, w in enumerate("abcdefgh")]
    return pa.table({"prompt": prompts, "schema": pa.array(ROW_SCHEMAS, pa.string())})


def check_rows(rows: list[dict], default: dict | None) -> None:
    """Every row's outcome against its own schema (``default`` for the null one)."""
    assert len(rows) == len(ROW_SCHEMAS)
    for r in rows:
        i = r["row_id"]
        if i in INVALID:
            assert r["status"] == "invalid_json_schema", r
            assert f"row {i}" in r["message"] and "input.json_schema_column" in r["message"]
            continue
        text = ROW_SCHEMAS[i]
        schema = json.loads(text) if text is not None else default
        if r["status"] == "json_incomplete":
            assert schema is not None and r["finish_reason"] == "length"
            continue
        assert r["status"] == "ok", r
        if schema is not None:
            jsonschema.validate(json.loads(r["output_text"]), schema)
    constrained_ok = [
        r for r in rows if r["status"] == "ok" and ROW_SCHEMAS[r["row_id"]] is not None
    ]
    assert len(constrained_ok) >= 3, rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("json-col")
    model = build_model(tmp / "model")
    data = tmp / "rows.parquet"
    pq.write_table(schema_table(), data)
    return tmp, model, data


def job(tmp: Path, model: Path, data: Path, name: str, extra: str = "") -> Path:
    f = tmp / f"{name}.toml"
    f.write_text(
        f'[input]\npath = "{data}"\njson_schema_column = "schema"\n'
        f'[model]\npath = "{model}"\ndevice = "cpu"\n'
        f"[sampling]\nmax_tokens = 48\n{extra}\n"
        '[engine]\nkv_cache_bytes = "8MiB"\nthreads = 1\n'
        f'[output]\npath = "{tmp / name}.parquet"\noverwrite = true\n'
    )
    return f


@pytest.mark.parametrize("default", [None, LIST], ids=["null-free", "null-job-schema"])
def test_rows_validate_against_their_own_schema(setup, default):
    tmp, model, data = setup
    extra = ""
    if default is not None:
        extra = "json_schema = " + json.dumps(json.dumps(default))
    name = "free" if default is None else "dflt"
    r = cli("run", job(tmp, model, data, name, extra))
    assert r.exit_code == 0, r.output
    check_rows(read_results(tmp / f"{name}.parquet").to_pylist(), default)


def test_column_errors(setup, tmp_path):
    tmp, model, data = setup
    # a column that does not exist, or is not a string: exit 4 naming it
    f = job(tmp, model, data, "missing").read_text().replace('"schema"', '"nope"')
    (tmp_path / "m.toml").write_text(f)
    r = cli("run", tmp_path / "m.toml")
    assert r.exit_code == EXIT_INPUT and "input.json_schema_column" in r.output, r.output
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "schema": [1]}), ints)
    r = cli("run", job(tmp, model, ints, "ints"))
    assert r.exit_code == EXIT_INPUT and "expected string" in r.output, r.output
    # scoring has no schema
    r = cli("run", job(tmp, model, data, "scoring", 'labels = [" a", " b"]'))
    assert r.exit_code == EXIT_CONFIG and "input.json_schema_column" in r.output, r.output


def test_vllm_refusals_are_checked_per_row():
    """On the vLLM backend a schema vLLM's xgrammar backend would refuse at submission (the
    whole job would fail) is found while reading the rows, so only its row is rejected."""
    pytest.importorskip("vllm")
    from batchjob.config.json_schema import compact_json_schema

    schema = '{"type": "integer", "multipleOf": 3}'
    assert compact_json_schema(schema) == '{"multipleOf":3,"type":"integer"}'
    with pytest.raises(ValueError, match="vLLM's xgrammar backend refuses"):
        compact_json_schema(schema, vllm=True)


def test_a_schema_whose_compile_runs_away_rejects_only_its_row(setup, tmp_path):
    """A schema xgrammar would build for minutes (about 28 s here; 2,000 levels: no end)
    rejects its row once the per-row limit passes (batchjob.guard); the job goes on."""
    from tests.test_guard import nested_schema

    _, model, _ = setup
    data = tmp_path / "slow-rows.parquet"
    schemas = [A, B, nested_schema(450)]  # last: no row waits for the guard's restart
    pq.write_table(pa.table({"prompt": ["one", "two", "three"], "schema": schemas}), data)
    r = cli("run", job(tmp_path, model, data, "slow"))
    assert r.exit_code == 0, r.output
    rows = read_results(tmp_path / "slow.parquet").to_pylist()
    assert rows[2]["status"] == "invalid_json_schema", rows[2]
    assert "row 2" in rows[2]["message"] and "input.json_schema_column" in rows[2]["message"]
    assert "took more than 2 s (the limit per row)" in rows[2]["message"]
    assert {rows[0]["status"], rows[1]["status"]} <= {"ok", "json_incomplete"}
