"""What a checkpoint's own files say about running it: a ``quantization_config`` in
config.json is refused by the native engine at load (exit 5, naming the key and the vLLM
backend); ``model.quantization`` is for the vLLM backend only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchjob.config import load_job
from batchjob.errors import EXIT_CONFIG, EXIT_MODEL, ConfigError
from batchjob.model.info import read_model_info
from tests.e2e.jobkit import cli

SETTINGS = ["--set", "model.device=cpu", "--set", "engine.threads=1"]
SETTINGS += ["--set", "sampling.max_tokens=4", "--set", "engine.kv_cache_bytes=8MiB"]
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}


def with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_a_quantized_checkpoint_is_exit_5_on_the_native_engine(
    tmp_path: Path, run_model: Path, run_data: Path
) -> None:
    awq = with_config(run_model, tmp_path / "awq", quantization_config=AWQ)
    for cmd in ("plan", "run"):
        out = tmp_path / f"{cmd}.parquet"
        args = ("--input", run_data, "--model", awq, "--output", out, *SETTINGS)
        r = cli(cmd, *args, *(["--no-progress"] if cmd == "run" else []))
        assert r.exit_code == EXIT_MODEL, r.output
        assert "quantization_config (awq)" in r.output, r.output
        assert 'engine.backend = "vllm"' in r.output
        assert not out.exists()
    info = read_model_info(awq, device="cpu", native=False)  # what the vLLM backend reads
    assert info.num_layers == 2


def test_model_quantization_is_for_the_vllm_backend(tmp_path: Path, run_model: Path) -> None:
    sets = {"input.path": "x.parquet", "output.path": "o", "model.path": str(run_model)}
    with pytest.raises(ConfigError, match=r'model\.quantization: is for engine\.backend = "vllm"'):
        load_job(None, {**sets, "model.quantization": "awq"})
    job = load_job(None, {**sets, "model.quantization": "awq", "engine.backend": "vllm"})
    assert job.model.quantization == "awq"
    assert ConfigError.exit_code == EXIT_CONFIG
