"""LoRA adapters on ``engine.backend = "vllm"``: a LoRARequest per row; greedy outputs equal,
token for token, those of the model with that adapter merged into its weights (and the base
model's for rows without one), in a job mixing two adapters and none that is killed after
its first part file and resumed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.runner.pipeline import run as run_job
from batchjob.testing.lora_adapter import make_lora_adapter, merge_lora
from tests.backends.vllm.vllm_kit import job_for, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
NAMES = ["a", "b", None]


def _tokens(results: Path) -> dict[int, list[int]]:
    rows = pq.read_table(results).to_pylist()
    assert all(r["status"] == "ok" for r in rows), rows
    return {r["row_id"]: r["output_token_ids"] for r in rows}


def test_vllm_adapters_equal_merged_weights_and_resume(tmp_path, model_dir, dataset) -> None:
    table = pq.read_table(dataset).slice(0, 12)
    names = [NAMES[i % 3] for i in range(table.num_rows)]
    data = tmp_path / "rows.parquet"
    pq.write_table(table.append_column("adapter", pa.array(names, pa.string())), data)
    adapters = {n: make_lora_adapter(tmp_path / n, model_dir, seed=i) for i, n in enumerate("ab")}
    table_str = "{" + ", ".join(f'{k} = "{v}"' for k, v in adapters.items()) + "}"
    out = tmp_path / "lora.parquet"
    sets = {
        "model.adapters": table_str,
        "input.adapter_column": "adapter",
        "output.flush_rows": "2",
    }
    job = job_for(model_dir, data, out, "vllm", **sets)
    args = [f"--set={k}={v}" for k, v in {**_cli_sets(job), **sets}.items()]
    killed = subprocess.run(
        [sys.executable, "-m", "batchjob.cli", "run", "--no-progress", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), BATCHJOB_FAULT_POINT="part:2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    res = run_job(job, progress=False)  # resumes: the rows of the first part are kept
    got = _tokens(res.results_path)
    assert len(got) == table.num_rows

    for name in (*NAMES,):
        rows = [i for i, n in enumerate(names) if n == name]
        model = (
            merge_lora(model_dir, adapters[name], tmp_path / f"merged-{name}")
            if name
            else model_dir
        )
        sub = tmp_path / f"rows-{name}.parquet"
        pq.write_table(table.take(rows), sub)
        ref = run_job(job_for(model, sub, tmp_path / f"ref-{name}.parquet", "vllm"), progress=False)
        want = _tokens(ref.results_path)
        for j, i in enumerate(rows):
            assert got[i] == want[j], (name, i)
    # the base rows differ from the adapters' (the adapters do something)
    assert any(got[i] != got[i + 2] for i in range(0, table.num_rows - 2, 3))


def _cli_sets(job) -> dict[str, str]:
    """job_for's settings as --set pairs."""
    d = job.to_dict()
    keys = ["input.path", "model.path", "output.path", "engine.backend", "engine.block_size"]
    keys += ["engine.kv_cache_bytes", "engine.threads", "scheduler.chunk_size"]
    keys += ["sampling.max_tokens"]
    out = {k: str(d[k.split(".")[0]][k.split(".")[1]]) for k in keys}
    out["engine.vllm"] = "{enforce_eager = true}"
    return out
