"""Shared pieces of the vLLM backend tests: a tiny model vLLM's CPU kernels take, a
prefix-shared dataset with per-row max_tokens, jobs, and a native reference run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.backends.base import BackendConfig
from batchjob.config import (
    EngineConfig,
    JobConfig,
    ModelConfig,
    SamplingConfig,
    SchedulerConfig,
    load_job,
)
from batchjob.runner.pipeline import run as run_job
from batchjob.testing.tiny_model import make_tiny_model
from batchjob.testing.workloads import WORDS, make_workload

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (make install)")

RESULT_COLUMNS = ["row_id", "output_token_ids", "finish_reason", "output_text", "status"]


def build_model(folder: Path, family: str = "llama") -> Path:
    """Tiny ``family`` model (tiny_model.FAMILIES), fp32; head_dim 32 (vLLM's CPU attention
    takes 32, 64, 80, ... only)."""
    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    return make_tiny_model(
        folder, family=family, vocab_size=2500, corpus=corpus, hidden=64, heads=2, kv_heads=2,
        head_dim=32,
    )  # fmt: skip


def build_dataset(path: Path, seed: int = 5, scale: float = 0.02, max_tokens=(3, 17)) -> Path:
    """case1 text rows (shared instruction, documents shared by ~7 rows, distinct queries),
    shuffled, with per-row max_tokens drawn from ``max_tokens``."""
    table = make_workload("case1", scale=scale, len_scale=0.08, seed=seed, form="text")
    rng = np.random.default_rng(seed)
    mt = rng.integers(max_tokens[0], max_tokens[1], table.num_rows).astype(np.int32)
    table = table.set_column(
        table.schema.get_field_index("max_tokens"), "max_tokens", pa.array(mt, pa.int32())
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def job_for(model: Path, data: Path, out: Path, backend: str, **overrides: str) -> JobConfig:
    """A job as ``batchjob run --set`` would build it (block 32: vLLM CPU's granularity)."""
    sets = {
        "input.path": str(data),
        "model.path": str(model),
        "output.path": str(out),
        "engine.backend": backend,
        "engine.block_size": "32",
        "engine.kv_cache_bytes": "2MiB",
        "engine.threads": "1",
        "scheduler.chunk_size": "256",
        "sampling.max_tokens": "8",
    }
    if backend == "vllm":
        sets["engine.vllm"] = "{enforce_eager = true}"  # start-up without torch.compile
    return load_job(None, sets | overrides)


def native_results(model: Path, data: Path, out: Path, **overrides: str) -> list[dict]:
    """The native engine's results of the same job (the reference), in row order."""
    return backend_results(model, data, out, "native", **overrides)


def backend_results(model: Path, data: Path, out: Path, backend: str, **overrides: str):
    """``job_for``'s job run on ``backend`` -> its results (``RESULT_COLUMNS``), in row order."""
    res = run_job(job_for(model, data, out, backend, **overrides), progress=False)
    return pq.read_table(res.results_path).select(RESULT_COLUMNS).to_pylist()


def both_results(model: Path, data: Path, tmp: Path, name: str = "", **overrides: str):
    """The same job on each backend (results ``tmp/{name}{backend}.parquet``) -> their
    results by backend name, native first."""
    return {
        b: backend_results(model, data, tmp / f"{name}{b}.parquet", b, **overrides)
        for b in ("native", "vllm")
    }


def backend_config(model: ModelConfig, engine: EngineConfig | None = None) -> BackendConfig:
    """The vLLM backend's settings for ``model`` with the other sections at their defaults."""
    return BackendConfig(
        model=model,
        sampling=SamplingConfig(),
        scheduler=SchedulerConfig(),
        engine=engine or EngineConfig(backend="vllm"),
        labels_column=None,
        json_schema_column=None,
        regex_column=None,
        choice_column=None,
    )
