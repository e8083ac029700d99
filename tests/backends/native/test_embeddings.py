"""Native embeddings (``model.task = "embed"``) against transformers' hidden states pooled the
same way, on Qwen3- and Mistral-shaped tiny models, with rows sharing an instruction prefix
(the plan computes it once per group) and prompts cut into several prefill chunks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import batchjob
from batchjob.testing.embedding_model import make_tiny_embedding_model

transformers = pytest.importorskip("transformers")

CORPUS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 20
FAMILIES = ("qwen3", "mistral")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed_models")
    return {
        f: make_tiny_embedding_model(
            root / f, family=f, pooling=None, vocab_size=300, seed=i, corpus=CORPUS
        )
        for i, f in enumerate(FAMILIES)
    }


def _rows(seed: int = 0) -> list[list[int]]:
    """Token-id rows: two instructions (40 and 23 tokens) shared by several queries each, and
    two rows that share nothing; lengths 1 to 30 after the instruction."""
    rng = np.random.default_rng(seed)
    instr = [rng.integers(3, 300, 40).tolist(), rng.integers(3, 300, 23).tolist()]
    rows = []
    for k, n in enumerate((1, 7, 30, 12, 3, 19, 25)):
        rows.append([1, *instr[k % 2], *rng.integers(3, 300, n).tolist()])
    rows += [[1, *rng.integers(3, 300, 9).tolist()], [2, *rng.integers(3, 300, 33).tolist()]]
    return rows


@torch.no_grad()
def _reference(folder, rows, method: str, normalize: bool, dims: int | None) -> np.ndarray:
    """transformers' last_hidden_state (after the final norm) of each row alone, pooled."""
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for ids in rows:
        h = hf(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
        v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
        v = v[:dims] if dims else v
        out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return torch.stack(out).numpy()


def _embed(folder, rows, **model) -> pa.Table:
    table = pa.table({"prompt": pa.array(rows, pa.list_(pa.int32()))})
    return batchjob.generate(
        table,
        model={"path": str(folder), "task": "embed", "device": "cpu", **model},
        scheduler={"chunk_size": 16},  # prefixes and rows in several chunks each
        engine={"kv_cache_bytes": "4MiB", "threads": 1},
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_pooled(models, family, method):
    rows = _rows()
    out = _embed(models[family], rows, pooling=method, normalize=False)
    got = np.asarray(out["embedding"].to_pylist(), dtype=np.float32)
    want = _reference(models[family], rows, method, normalize=False, dims=None)
    assert out["embedding"].type == pa.list_(pa.float32())
    assert got.shape == want.shape == (len(rows), 64)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert out["status"].to_pylist() == ["ok"] * len(rows)
    assert out["output_text"].null_count == len(rows)
    assert set(out["num_output_tokens"].to_pylist()) == {0}


def test_normalize_and_matryoshka_dimensions(tmp_path):
    folder = make_tiny_embedding_model(
        tmp_path / "m", family="qwen3", pooling="mean", normalize=True, matryoshka=True,
        vocab_size=300, corpus=CORPUS,
    )  # fmt: skip
    rows = _rows(seed=1)
    out = _embed(folder, rows, dimensions=24)  # pooling and normalize from the folder's files
    got = np.asarray(out["embedding"].to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(got, _reference(folder, rows, "mean", True, 24), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
