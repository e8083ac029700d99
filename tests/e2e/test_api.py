"""The Python API over data in memory (``batchjob.generate``, ``Generator``,
``generate_batches``) on a tiny model: the same outputs as ``batchjob run`` row for row, the
engine loaded once per Generator, row ids counting on across a stream, the settings checked
by the job file's sections, every supported kind of data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchjob
from batchjob.errors import ConfigError, InputDataError
from batchjob.outputs.results import RESULT_SCHEMA
from batchjob.testing.workloads import make_workload
from tests.e2e.jobkit import ROOT, cli, read_results

DEMO = ROOT / "jobs" / "demo.toml"
FAST = {"device": "cpu"}
ENGINE = {"threads": 1, "kv_cache_bytes": "8MiB"}


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's prompts (examples/demo.py): case1 at 2% scale, text, max_tokens 16."""
    table = make_workload("case1", scale=0.02, len_scale=0.1, seed=0, form="text", max_tokens=16)
    path = tmp_path_factory.mktemp("demo-data") / "prompts.parquet"
    pq.write_table(table, path)
    return path


def test_generate_equals_batchjob_run_row_for_row(
    tmp_path: Path, run_model: Path, demo_data: Path
) -> None:
    out = tmp_path / "results.parquet"
    r = cli(
        "run", DEMO, "--input", demo_data, "--model", run_model, "--output", out,
        "--set", "model.device=cpu", "--set", "engine.threads=1", "--no-progress",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    want = read_results(out)

    df = pl.read_parquet(demo_data)
    got = batchjob.generate(df, job=DEMO, model={"path": run_model, **FAST}, engine={"threads": 1})
    assert isinstance(got, pa.Table) and got.num_rows == df.height == want.num_rows
    assert got.column_names == want.column_names
    assert got["row_id"].to_pylist() == list(range(df.height))  # input order
    for name in want.column_names:
        assert got[name].to_pylist() == want[name].to_pylist(), name
    assert set(got["status"].to_pylist()) == {"ok"}


def test_generator_loads_the_engine_once(run_model: Path, monkeypatch) -> None:
    import batchjob.runner.execute as ex

    opened = []
    real = ex.open_job_backend

    def counting(*args, **kwargs):
        opened.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ex, "open_job_backend", counting)
    prompts = ["babu bado bafe", "babu bado bake", "kima kude"]
    with batchjob.Generator(model=run_model, sampling={"max_tokens": 4}, engine=ENGINE) as g:
        first = g.generate(prompts)
        second = g.generate(pl.DataFrame({"prompt": prompts, "tag": ["a", "b", "c"]}))
        assert g._backend is not None
    assert g._backend is None and len(opened) == 1  # closed at the end of the block
    assert first["output_text"].to_pylist() == second["output_text"].to_pylist()
    assert second["tag"].to_pylist() == ["a", "b", "c"]  # other columns pass through
    assert first["num_output_tokens"].to_pylist() == [4, 4, 4]


def test_generate_batches_streams_tables_with_row_ids_counting_on(run_model: Path) -> None:
    rng = np.random.default_rng(0)

    def tables():
        for n in (5, 3, 4):
            ids = [rng.integers(3, 2000, 6).tolist() for _ in range(n)]
            yield pa.table({"prompt": pa.array(ids, pa.list_(pa.int32())), "n": [n] * n})

    outs = list(
        batchjob.generate_batches(
            tables(), model=run_model, sampling={"max_tokens": 2}, engine=ENGINE
        )
    )
    assert [t.num_rows for t in outs] == [5, 3, 4]
    ids = pa.concat_tables(outs)["row_id"].to_pylist()
    assert ids == list(range(12))
    assert all(t["status"].to_pylist() == ["ok"] * t.num_rows for t in outs)
    assert outs[1]["n"].to_pylist() == [3, 3, 3]
    # one table read input.batch_rows rows at a time; input.limit counts over the stream
    table = pa.table({"prompt": ["babu bado"] * 7})
    parts = list(
        batchjob.generate_batches(
            table, model=run_model, input={"batch_rows": 3, "limit": 5},
            sampling={"max_tokens": 1}, engine=ENGINE,
        )
    )  # fmt: skip
    assert [t["row_id"].to_pylist() for t in parts] == [[0, 1, 2], [3, 4]]


def test_kinds_of_data_and_rejected_rows(run_model: Path) -> None:
    settings = {"model": run_model, "sampling": {"max_tokens": 2}, "engine": ENGINE}
    text = batchjob.generate(["babu bado", "", None, "kima"], **settings)
    assert text["status"].to_pylist() == ["ok", "empty_prompt", "empty_prompt", "ok"]
    assert "row 1" in text["message"][1].as_py()
    ids = batchjob.generate([[1, 50, 60], [1, 70]], **settings)
    assert ids["num_prompt_tokens"].to_pylist() == [3, 2]
    batch = pa.RecordBatch.from_pydict({"question": ["babu bado"], "max_tokens": [1]})
    one = batchjob.generate(batch, input={"prompt_column": "question"}, **settings)
    assert one["num_output_tokens"].to_pylist() == [1]  # the max_tokens column, per row
    unused = batchjob.generate(
        batch, input={"prompt_column": "question", "max_tokens_column": None}, **settings
    )
    assert unused["num_output_tokens"].to_pylist() == [2]
    assert batchjob.generate([], **settings).num_rows == 0
    empty = batchjob.generate(pa.table({"prompt": pa.array([], pa.string())}), **settings)
    assert empty.num_rows == 0 and empty.schema.names == RESULT_SCHEMA.names
    with pytest.raises(InputDataError, match="column 'prompt'"):
        batchjob.generate(pa.table({"text": ["a"]}), **settings)
    with pytest.raises(InputDataError, match="expected a pyarrow Table"):
        batchjob.generate(42, **settings)


def test_pandas_dataframe(run_model: Path) -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"prompt": ["babu bado", "kima"], "k": [1, 2]})
    out = batchjob.generate(df, model=run_model, sampling={"max_tokens": 1}, engine=ENGINE)
    assert out["k"].to_pylist() == [1, 2] and out["status"].to_pylist() == ["ok", "ok"]


@pytest.mark.parametrize(
    "settings, match",
    [
        (
            {"sampling": {"max_tokens": 0}},
            r"sampling\.max_tokens: must be >= 1, got 0 \(generate\(\)\)",
        ),
        ({"sampling": {"max_token": 5}}, r"did you mean sampling\.max_tokens\?"),
        ({"max_tokens": 16}, r"sampling=\{'max_tokens': \.\.\.\}"),
        ({"samplng": {"max_tokens": 5}}, r"did you mean sampling=\{\.\.\.\}\?"),
        ({"sampling": 16}, r"sampling: must be a table"),
        ({"output": {"path": "x.parquet"}}, r"output: not a setting of generate\(\)"),
        ({"input": {"path": "x.parquet"}}, r"input\.path: generate\(\) reads its data"),
        ({"engine": {"backend": "other"}}, r"engine\.backend: must be one of native, vllm"),
    ],
)
def test_settings_are_checked_as_a_job_files(settings: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        batchjob.Generator(model="models/none", **settings)


def test_a_job_file_or_config_to_start_from(run_model: Path) -> None:
    g = batchjob.Generator(job=DEMO, model={"path": run_model}, sampling={"max_tokens": 3})
    assert g.job.sampling.max_tokens == 3 and g.job.scheduler.chunk_size == 512  # the file's
    assert g.job.engine.kv_cache_bytes == 64 * 2**20
    again = batchjob.Generator(job=g.job, sampling={"temperature": 0.5})
    assert again.job.sampling.max_tokens == 3 and again.job.sampling.temperature == 0.5


def test_import_batchjob_loads_no_torch() -> None:
    code = (
        "import sys, batchjob; batchjob.generate; batchjob.Generator; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
