"""docs/migrating.md's vLLM and Ray Data snippets, run as written in a folder laid out as
after ``make demo``: the vLLM one as a script (no ``__main__`` guard, one vLLM start for two
``generate`` calls), the Ray Data recipe on a local Ray over 100 rows, its results equal to a
single-process ``batchjob.generate`` of the same rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

import batchjob
from tests.doc_snippets import ROOT, scratch, snippets

pytestmark = pytest.mark.slow


def _script(folder: Path, code: str, tail: str = "") -> subprocess.CompletedProcess:
    path = folder / "snippet.py"
    path.write_text(code + tail)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(path)], cwd=folder, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.backends.vllm.vllm_kit import build_model  # head_dim 32: vLLM's CPU kernels

    return build_model(tmp_path_factory.mktemp("migrating-model") / "tiny")


def test_vllm_snippet_runs_as_written(tmp_path: Path, run_model: Path) -> None:
    pytest.importorskip("vllm")
    scratch(tmp_path, run_model)
    (code,) = snippets("vllm")
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if "second = " in line)
    lines.insert(at + 1, "    starts = g._backend.starts  # engines started so far")  # counted
    check = "\nassert starts == 1, starts\nprint(first['status'][0], second['status'][0])\n"
    code = "\n".join(lines)
    res = _script(tmp_path, code, check)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "ok ok", res.stdout


def test_ray_data_recipe_equals_a_single_process_run(tmp_path: Path, run_model: Path) -> None:
    """As written (one batch of the 100 rows), then in batches of 25 (four tables, each
    planned on its own, row_id from 0 in each): per row, what one process generates."""
    pytest.importorskip("ray")
    scratch(tmp_path, run_model, rows=100)
    (code,) = snippets("ray")
    data = pq.read_table(tmp_path / "data" / "demo" / "prompts.parquet")
    model = tmp_path / "models" / "tiny-llama"
    want = batchjob.generate(data, model=model, sampling={"max_tokens": 16})
    cols = ["request_id", "status", "output_text", "output_token_ids"]
    expected = want.select(cols).sort_by("request_id").to_pylist()
    assert want.num_rows == 100 and {r["status"] for r in expected} == {"ok"}
    small = code.replace("batch_size=4096", "batch_size=25").replace("ray_results", "ray_25")
    assert small != code
    for variant, out in ((code, "ray_results"), (small, "ray_25")):
        res = _script(tmp_path, variant)
        assert res.returncode == 0, res.stderr[-3000:]
        got = pads.dataset(tmp_path / "out" / out).to_table()
        assert got.select(cols).sort_by("request_id").to_pylist() == expected, out
    row_ids = pads.dataset(tmp_path / "out" / "ray_25").to_table().column("row_id").to_pylist()
    assert sorted(row_ids) == sorted(list(range(25)) * 4)  # four tables of 25
