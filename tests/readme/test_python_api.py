"""README's Python API example, run as written (the block between ``<!-- python-api -->``
markers), in a scratch folder holding the demo's data and a tiny model where the example
expects them (``models/tiny-llama``, ``data/demo/prompts.parquet``)."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchjob.testing.workloads import make_workload

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- python-api -->\s*```python\n(.*?)```\s*<!-- /python-api -->", re.S)


def test_python_api_example_runs(tmp_path: Path, run_model: Path, monkeypatch) -> None:
    m = BLOCK.search((ROOT / "README.md").read_text())
    assert m, "README.md has no ```python block between <!-- python-api --> markers"
    code = m.group(1)
    assert len(code.strip().splitlines()) <= 12
    shutil.copytree(run_model, tmp_path / "models" / "tiny-llama")
    table = make_workload("case1", scale=0.02, len_scale=0.1, seed=0, form="text", max_tokens=16)
    (tmp_path / "data" / "demo").mkdir(parents=True)
    pq.write_table(table, tmp_path / "data" / "demo" / "prompts.parquet")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue().splitlines()
    assert "output_text" in out.getvalue()
    parts = [line for line in printed if re.fullmatch(r"\d+ \d+", line)]
    assert [int(p.split()[0]) for p in parts] == [20, 20, 20]  # 60 rows, batches of 20
    assert [int(p.split()[1]) for p in parts] == [0, 20, 40]  # row ids count on


@pytest.fixture(scope="module")
def run_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.e2e.jobkit import build_model

    return build_model(tmp_path_factory.mktemp("readme-model") / "tiny")
