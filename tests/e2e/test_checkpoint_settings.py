"""What a checkpoint's own files say about running it: a ``quantization_config`` in
config.json is refused by the native engine at load (exit 5, naming the key and the vLLM
backend); ``model.quantization`` is for the vLLM backend only; generation_config.json's
sampling defaults apply to the [sampling] keys a job leaves unset (vLLM's
``generation_config = "auto"``), unless ``model.generation_config = "none"``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import batchjob
from batchjob.config import load_job
from batchjob.errors import EXIT_CONFIG, EXIT_MODEL, ConfigError
from batchjob.model.hf_config import generation_sampling_defaults
from batchjob.model.info import read_model_info
from tests.e2e.jobkit import cli, read_results

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


def with_generation(src: Path, dst: Path, **sampling: object) -> Path:
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, **sampling}))
    return dst


def test_which_generation_config_keys_are_defaults() -> None:
    hf_defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
    assert generation_sampling_defaults({**hf_defaults, "do_sample": True}) == {}  # vLLM's rule
    qwen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert generation_sampling_defaults({**qwen, "max_new_tokens": 9, "min_p": 0.1}) == {
        **qwen, "max_tokens": 9, "min_p": 0.1,
    }  # fmt: skip


def test_generation_config_defaults_apply_to_what_the_job_leaves_unset(
    tmp_path: Path, run_model: Path, run_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hot = with_generation(run_model, tmp_path / "hot", temperature=0.9, top_k=40)
    sets = {"input.path": str(run_data), "output.path": "o", "model.path": str(hot)}
    with caplog.at_level("WARNING", logger="batchjob"):
        job = load_job(None, sets)
    assert (job.sampling.temperature, job.sampling.top_k) == (0.9, 40)
    assert "generation_config.json: temperature = 0.9, top_k = 40" in caplog.text
    job = load_job(None, {**sets, "sampling.temperature": "0.0"})  # the job's own wins
    assert (job.sampling.temperature, job.sampling.top_k) == (0.0, 40)
    job = load_job(None, {**sets, "model.generation_config": "none"})
    assert (job.sampling.temperature, job.sampling.top_k) == (0.0, 0)  # batchjob's defaults
    scoring = load_job(None, {**sets, "sampling.labels": '["a", "b"]'})
    assert scoring.sampling.temperature == 0.0  # scoring draws nothing: no defaults

    bad = with_generation(run_model, tmp_path / "bad", temperature=-1.0)
    with pytest.raises(ConfigError, match=r"sampling\.temperature.*bad/generation_config\.json"):
        load_job(None, {**sets, "model.path": str(bad)})

    prompts = pq.read_table(run_data)["prompt"].to_pylist()[:6]
    common = {"sampling": {"max_tokens": 6}, "engine": {"threads": 1, "kv_cache_bytes": "8MiB"}}
    sampled = batchjob.generate(prompts, model={"path": hot, "device": "cpu"}, **common)
    want = batchjob.generate(
        prompts,
        model={"path": run_model, "device": "cpu"},
        sampling={"max_tokens": 6, "temperature": 0.9, "top_k": 40},
        engine=common["engine"],
    )
    assert sampled["output_token_ids"].to_pylist() == want["output_token_ids"].to_pylist()


def test_a_greedy_generation_config_makes_an_unset_job_greedy(
    tmp_path: Path, run_model: Path, run_data: Path
) -> None:
    cold = with_generation(run_model, tmp_path / "cold", temperature=0.0, top_p=0.5)
    runs = {}
    for name, model in (("cold", cold), ("plain", run_model)):
        out = tmp_path / f"{name}.parquet"
        r = cli("run", "--input", run_data, "--model", model, "--output", out, *SETTINGS,
                "--no-progress")  # fmt: skip
        assert r.exit_code == 0, r.output
        runs[name] = read_results(out)["output_token_ids"].to_pylist()
    assert runs["cold"] == runs["plain"]  # greedy: top_p has no effect on argmax
    sets = {"input.path": str(run_data), "output.path": "o", "model.path": str(cold)}
    assert load_job(None, sets).sampling.greedy
