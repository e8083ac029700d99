"""Structured output (``sampling.json_schema``) end to end on the tiny random-weight model.

Unconstrained, a random model writes garbage, so every ``ok`` row parsing and validating
against the schema (with ``jsonschema``, an independent validator) is a real check of the
xgrammar-masked decoding. A tiny ``max_tokens`` cuts the JSON: finish "length", status
``json_incomplete``. A bad schema is exit 3 naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchjob.errors import EXIT_CONFIG
from tests.e2e.jobkit import build_model, cli, read_results

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"enum": ["positive", "negative", "neutral"]},
    },
    "required": ["name", "count", "label"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("json")
    model = build_model(tmp / "model")
    prompts = [f"review {i}: the {w} was fine and the price" for i, w in enumerate("abcdefgh")]
    data = tmp / "reviews.parquet"
    pq.write_table(pa.table({"prompt": prompts}), data)
    (tmp / "schema.json").write_text(json.dumps(SCHEMA))
    return tmp, model, data


def job(tmp: Path, model: Path, data: Path, name: str, sampling: str) -> Path:
    f = tmp / f"{name}.toml"
    f.write_text(
        f'[input]\npath = "{data}"\n[model]\npath = "{model}"\ndevice = "cpu"\n'
        f"[sampling]\n{sampling}\n[engine]\n"
        'kv_cache_bytes = "8MiB"\nthreads = 1\n'
        f'[output]\npath = "{tmp / name}.parquet"\noverwrite = true\n'
    )
    return f


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ok_rows_validate(setup, temperature):
    tmp, model, data = setup
    # a file path, relative to the job file (resolved against its directory)
    f = job(
        tmp,
        model,
        data,
        f"t{temperature}",
        f'json_schema = "schema.json"\nmax_tokens = 64\ntemperature = {temperature}',
    )
    r = cli("run", f)
    assert r.exit_code == 0, r.output
    t = read_results(tmp / f"t{temperature}.parquet").to_pylist()
    assert len(t) == 8
    ok = [row for row in t if row["status"] == "ok"]
    assert len(ok) >= 6, [(row["status"], row["output_text"]) for row in t]
    for row in ok:
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["output_text"]), SCHEMA)
    for row in t:
        if row["status"] != "ok":
            assert (row["status"], row["finish_reason"]) == ("json_incomplete", "length")


def test_max_tokens_cut_is_json_incomplete(setup):
    tmp, model, data = setup
    inline = json.dumps(SCHEMA).replace('"', '\\"')
    f = job(tmp, model, data, "short", f'json_schema = "{inline}"\nmax_tokens = 3')
    r = cli("run", f)
    assert r.exit_code == 0, r.output
    t = read_results(tmp / "short.parquet").to_pylist()
    assert len(t) == 8
    for row in t:
        assert row["finish_reason"] == "length"
        assert row["status"] == "json_incomplete"
        assert "incomplete (max_tokens = 3 reached)" in row["message"]
        with pytest.raises(ValueError):
            json.loads(row["output_text"])


@pytest.mark.parametrize(
    "value",
    ['"{not json"', '"missing.json"', '"[1, 2]"', '"{\\"type\\": \\"no-such-type\\"}"'],
)
def test_bad_schema_is_exit_3(setup, value):
    tmp, model, data = setup
    f = job(tmp, model, data, "bad", f"json_schema = {value}")
    r = cli("run", f)
    assert r.exit_code == EXIT_CONFIG, r.output
    assert "sampling.json_schema" in r.output


def test_utf8_masks_block_surrogates(setup):
    """xgrammar admits ED A0..BF (a UTF-16 surrogate, invalid UTF-8; found on the labeling
    example): after a token ending in byte ED, tokens starting with A0..BF are masked."""
    from batchjob.backends.native.structured import GrammarConstraint, _bad_utf8_pair
    from batchjob.config.guided import Guide

    assert _bad_utf8_pair(b"\xed\xa0") and _bad_utf8_pair(b"\xc0") and _bad_utf8_pair(b"\xf5")
    assert not _bad_utf8_pair("é€😀".encode()) and not _bad_utf8_pair(b"\xed")
    _, model, _ = setup
    c = GrammarConstraint(model, Guide("json", json.dumps({"type": "string"})), 2500, [2])
    vocab = c._bytes
    lead = vocab.index(b"\xed")
    for tok in (vocab.index(b'"'), lead):
        c.mask(torch.zeros(1, 2500), [0])
        assert not c.accept(0, tok)
    logits = torch.zeros(1, 2500)
    c.mask(logits, [0])
    assert torch.isinf(logits[0, vocab.index(b"\xa0")])  # surrogate: masked
    assert not torch.isinf(logits[0, vocab.index(b"\x80")])  # U+D000..: allowed
    assert c.problem(0) == ("json_incomplete", "the JSON output is incomplete")
