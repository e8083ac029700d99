"""Embeddings on the vLLM backend (vLLM's pooling runner) against transformers' hidden states
pooled the same way, on Qwen3- and Mistral-shaped tiny models (head_dim 32 for vLLM's CPU
attention), rows sharing an instruction prefix."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import batchjob
from batchjob.testing.embedding_model import make_tiny_embedding_model
from tests.backends.vllm.vllm_kit import needs_vllm

transformers = pytest.importorskip("transformers")
pytestmark = needs_vllm

CORPUS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 20


def _rows() -> list[list[int]]:
    rng = np.random.default_rng(0)
    instr = rng.integers(3, 300, 40).tolist()
    return [[1, *instr, *rng.integers(3, 300, n).tolist()] for n in (1, 9, 30, 4, 17)] + [
        [1, *rng.integers(3, 300, 12).tolist()]
    ]


@torch.no_grad()
def _reference(folder, rows, method: str, dims: int | None) -> np.ndarray:
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for ids in rows:
        h = hf(torch.tensor([ids])).last_hidden_state[0]
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
        out.append(torch.nn.functional.normalize(v[:dims] if dims else v, dim=-1))
    return torch.stack(out).numpy()


@pytest.mark.parametrize(
    ("family", "method", "dims"), [("qwen3", "mean", None), ("mistral", "last", 48)]
)
def test_vllm_embeddings_equal_transformers_pooled(tmp_path, family, method, dims):
    folder = make_tiny_embedding_model(
        tmp_path / family, family=family, pooling=method, normalize=True, matryoshka=True,
        vocab_size=300, corpus=CORPUS, heads=2, kv_heads=2, head_dim=32,
    )  # fmt: skip
    rows = _rows()
    table = pa.table({"prompt": pa.array(rows, pa.list_(pa.int32()))})
    model = {"path": str(folder), "task": "embed", "dtype": "float32"}
    if dims:
        model["dimensions"] = dims
    engine = {"kv_cache_bytes": "8MiB", "threads": 1, "block_size": 32}
    out = batchjob.generate(table, model=model, engine={**engine, "backend": "vllm"})
    got = np.asarray(out["embedding"].to_pylist(), dtype=np.float32)
    assert got.shape == (len(rows), dims or 64)
    np.testing.assert_allclose(got, _reference(folder, rows, method, dims), atol=1e-4, rtol=0)
    assert out["status"].to_pylist() == ["ok"] * len(rows)
    native = batchjob.generate(table, model=model, engine={**engine, "block_size": 16})
    np.testing.assert_allclose(got, np.asarray(native["embedding"].to_pylist()), atol=1e-4)


def test_vllm_embedding_job_reports_iterations(tmp_path):
    """An embedding job on the vLLM backend writes one iteration record per engine step
    (vLLM's own policy, recorded): their prefill tokens add up to the report's computed
    tokens."""
    from batchjob.config import load_job
    from batchjob.runner.pipeline import run as run_job

    folder = make_tiny_embedding_model(
        tmp_path / "m", family="qwen3", pooling="last", vocab_size=300, corpus=CORPUS,
        heads=2, kv_heads=2, head_dim=32,
    )  # fmt: skip
    rows = _rows()
    data = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": pa.array(rows, pa.list_(pa.int32()))}), data)
    sets = {"input.path": str(data), "model.path": str(folder), "model.task": "embed"}
    sets |= {"output.path": str(tmp_path / "out.parquet"), "engine.backend": "vllm"}
    sets |= {"engine.kv_cache_bytes": "8MiB", "engine.threads": "1", "engine.block_size": "32"}
    res = run_job(load_job(None, sets), progress=False)
    meta = tmp_path / "out.parquet.meta"
    report = json.loads((meta / "report.json").read_text())
    its = pq.read_table(meta / "report.iterations.parquet")
    assert its.num_rows >= 1 and report["iterations"] == its.num_rows
    computed = report["computed_prefill_tokens"]
    assert sum(its["prefill_tokens"].to_pylist()) == computed
    assert 0 < computed <= sum(map(len, rows))
    assert set(pq.read_table(res.results_path)["status"].to_pylist()) == {"ok"}
