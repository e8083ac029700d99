"""Bad-input fuzzing: hypothesis-generated Parquet datasets and job settings run through
``batchjob run`` on a tiny real model. Every outcome must be success with exactly one result
row per input row, or a documented exit code with one ``error:`` line, never a traceback.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batchjob import errors
from batchjob.cli import main
from tests.e2e.jobkit import build_model

DOCUMENTED = {
    errors.EXIT_OK,
    errors.EXIT_CONFIG,
    errors.EXIT_INPUT,
    errors.EXIT_MODEL,
    errors.EXIT_ALL_REJECTED,
}
WORDS = ["alpha", "beta", "gamma", "delta", "", " ", "\n", "é", "数据", "a" * 50]

texts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=6).map(" ".join)
ids = st.lists(st.integers(-3, 3000), min_size=0, max_size=6)


KINDS = ["string", "large_string", "dict", "list32", "list64", "int", "null"]


@st.composite
def prompt_column(draw, n: int, kind: str) -> pa.Array:
    nullable = draw(st.booleans())
    if kind in ("string", "large_string", "dict"):
        vals = [None if nullable and draw(st.booleans()) else draw(texts) for _ in range(n)]
        arr = pa.array(vals, pa.large_string() if kind == "large_string" else pa.string())
        return arr.dictionary_encode() if kind == "dict" else arr
    if kind in ("list32", "list64"):
        vals = [None if nullable and draw(st.booleans()) else draw(ids) for _ in range(n)]
        if draw(st.booleans()) and n:  # a null inside a list
            vals[0] = [1, None, 2]
        return pa.array(vals, pa.list_(pa.int32() if kind == "list32" else pa.int64()))
    if kind == "int":
        return pa.array(list(range(n)), pa.int64())
    return pa.nulls(n)


@st.composite
def dataset(draw) -> list[pa.Table]:
    files = []
    kind = draw(st.sampled_from(KINDS[:5]))  # mostly one usable kind for every file
    has_mt = draw(st.booleans())
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 5))
        if draw(st.integers(0, 9)) == 0:
            kind = draw(st.sampled_from(KINDS))  # now and then a file that disagrees
        cols = {"prompt": draw(prompt_column(n, kind))}
        if has_mt:
            mt = st.one_of(st.none(), st.integers(-2, 8), st.just(2**40))
            cols["max_tokens"] = pa.array([draw(mt) for _ in range(n)], pa.int64())
        if draw(st.booleans()):
            extra = draw(st.sampled_from([pa.int64(), pa.string(), pa.float64(), pa.bool_()]))
            cols["extra"] = pa.nulls(n, extra)
        if draw(st.booleans()):
            cols["row_id"] = pa.array(list(range(n)), pa.int32())
        files.append(pa.table(cols))
    return files


GOOD_SETTINGS = [
    "sampling.max_tokens=3",
    "sampling.temperature=0.5",
    "input.limit=2",
    "input.batch_rows=1",
    "model.max_model_len=8",
    "output.rows_per_file=1",
    "engine.block_size=3",
    "engine.kv_cache_bytes=24KiB",
    "sampling.stop=['a']",
]
BAD_SETTINGS = [
    "sampling.max_tokens=0",
    "sampling.top_p=0",
    "input.prompt_column=text",
    "input.max_tokens_column=mt",
    "scheduler.chunk_size=0",
    "engine.kv_cache_bytes=1KiB",
]
job_settings = st.tuples(
    st.lists(st.sampled_from(GOOD_SETTINGS), max_size=3, unique=True),
    st.one_of(st.none(), st.none(), st.none(), st.sampled_from(BAD_SETTINGS)),
).map(lambda t: t[0] + ([t[1]] if t[1] else []))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("fuzz-model") / "tiny")


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(files=dataset(), sets=job_settings, dir_output=st.booleans())
def test_any_input_is_results_or_a_documented_error(model, files, sets, dir_output):
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    (work / "in").mkdir()
    for i, t in enumerate(files):
        pq.write_table(t, work / "in" / f"part-{i}.parquet")
    out = work / ("out" if dir_output else "out.parquet")
    args = ["run", "--input", str(work / "in"), "--output", str(out), "--model", str(model)]
    args += ["--set", "model.device=cpu", "--set", "sampling.max_tokens=2"]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(main, args)
    event(f"exit {res.exit_code}")
    assert res.exit_code in DOCUMENTED, (res.exit_code, res.output, repr(res.exception))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    if res.exit_code == 0:
        n = sum(t.num_rows for t in files)
        limit = next((int(s.split("=")[1]) for s in sets if s.startswith("input.limit")), n)
        got = pq.read_table(out).sort_by("row_id")
        assert got["row_id"].to_pylist() == list(range(min(n, limit)))
        assert set(got["status"].to_pylist()) <= {
            "ok",
            "empty_prompt",
            "prompt_too_long",
            "invalid_tokens",
            "invalid_max_tokens",
            "kv_budget_exceeded",
        }
    else:
        lines = [x for x in res.stderr.strip().splitlines() if not x.startswith("batchjob: ")]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
