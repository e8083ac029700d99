"""An embedding job end to end (``model.task = "embed"``): `batchjob plan` reports the saving,
`batchjob run` writes one float32 embedding per row, computes exactly the plan's prompt
tokens, and rejects bad rows and settings by name; the example job runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.testing.embedding_model import make_tiny_embedding_model
from batchjob.testing.workloads import WORDS
from tests.e2e.jobkit import ROOT, cli, cli_subprocess

INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\\nQuery: "


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory):
    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    return make_tiny_embedding_model(
        tmp_path_factory.mktemp("embed") / "m", family="qwen3", pooling="mean",
        normalize=True, vocab_size=1500, corpus=corpus,
    )  # fmt: skip


@pytest.fixture(scope="module")
def queries(tmp_path_factory):
    rng = np.random.default_rng(0)
    text: list[str | None] = [
        " ".join(rng.choice(WORDS, int(rng.integers(2, 9)))) for _ in range(40)
    ]
    text[7] = None  # rejected: the template's column is null
    path = tmp_path_factory.mktemp("embed_data") / "queries.parquet"
    pq.write_table(pa.table({"query": text, "max_tokens": [-5] * 40}), path)
    return path


def _job(tmp_path, model, data, *lines: str) -> str:
    job = tmp_path / "embed.toml"
    job.write_text(
        "\n".join(
            [
                "[input]",
                f'path = "{data}"',
                f'template = "{INSTRUCTION}{{query}}"',
                "[model]",
                f'path = "{model}"',
                'task = "embed"',
                'device = "cpu"',
                *lines,
                "[scheduler]",
                "chunk_size = 128",
                "[engine]",
                'kv_cache_bytes = "4MiB"',
                "threads = 1",
                "[output]",
                f'path = "{tmp_path / "emb.parquet"}"',
            ]
        )
        + "\n"
    )
    return str(job)


def test_embed_job_plan_and_run(tmp_path, embed_model, queries):
    job = _job(tmp_path, embed_model, queries)
    plan = cli("plan", job, "--json")
    assert plan.exit_code == 0, plan.output
    planned = json.loads(plan.stdout)
    assert planned["task"] == "embed" and "mean pooling" in planned["embedding"]
    assert planned["single_level_prefill_tokens"] < planned["logical_prefill_tokens"] / 3
    text = cli("plan", job).output
    assert "task          embed, mean pooling" in text and "prefill only" in text

    run = cli("run", job, "--json", "--no-progress")
    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout)
    # the shared instruction computed once per group: exactly the plan's prompt tokens
    assert report["computed_prefill_tokens"] == planned["single_level_prefill_tokens"]
    assert report["generated_tokens"] == 0 and report["task"] == "embed"
    assert report["requests_per_s"] > 0 and report["prompt_tokens_per_s"] > 0

    res = pq.read_table(tmp_path / "emb.parquet")
    assert res.schema.field("embedding").type == pa.list_(pa.float32())
    rows = res.to_pylist()
    assert len(rows) == 40 and rows[7]["status"] != "ok" and "query" in rows[7]["message"]
    assert rows[7]["embedding"] is None
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 39  # the max_tokens column of -5 rejects nothing: no row decodes
    emb = np.asarray([r["embedding"] for r in ok], dtype=np.float32)
    assert emb.shape == (39, 64)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)  # the Normalize
    assert all(r["output_text"] is None and r["finish_reason"] == "embed" for r in ok)
    again = cli("run", job, "--no-progress")
    assert again.exit_code == 0 and "already complete" in again.output


@pytest.mark.parametrize(
    ("lines", "key"),
    [
        (["[sampling]", "temperature = 0.5"], "sampling.temperature"),
        (['pooling = "max"'], "model.pooling"),
        (["dimensions = 16"], "model.dimensions"),  # config.json declares no Matryoshka
        (['pooling = "mean"', "[scheduler]", 'policy = "baseline"'], "scheduler.policy"),
    ],
)
def test_bad_embedding_settings_name_the_key(tmp_path, embed_model, queries, lines, key):
    job = _job(tmp_path, embed_model, queries, *lines)
    if "[scheduler]" in lines:  # one [scheduler] table
        text = Path(job).read_text().replace("[scheduler]\nchunk_size = 128\n", "")
        Path(job).write_text(text.replace('"baseline"', '"baseline"\nchunk_size = 128'))
    r = cli("run", job, "--no-progress")
    assert r.exit_code == 3, r.output
    assert f"error: {key}:" in (r.stderr or r.output)
    assert not (tmp_path / "emb.parquet").exists()


def test_embedding_keys_need_the_embed_task(tmp_path, embed_model, queries):
    job = _job(tmp_path, embed_model, queries, "normalize = false")
    Path(job).write_text(Path(job).read_text().replace('task = "embed"\n', ""))
    r = cli("plan", job)
    assert r.exit_code == 3 and 'model.normalize: is for model.task = "embed"' in r.stderr


def test_embed_example_job_runs(tmp_path):
    """jobs/embed_queries.toml (examples/embed_queries.py's model and data layout)."""
    model = ROOT / "models" / "tiny-qwen3-embed"
    if not (model / "config.json").exists():
        pytest.skip("the example's model is not built (python examples/embed_queries.py)")
    data = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": ["bade kimo", "lito nama dera"]}), data)
    out = tmp_path / "e.parquet"
    p = cli_subprocess(
        "run", ROOT / "jobs" / "embed_queries.toml", "--set", f"input.path={data}",
        "--set", f"output.path={out}", "--no-progress",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert [len(e) for e in pq.read_table(out)["embedding"].to_pylist()] == [64, 64]
