"""The ``[model]`` settings the vLLM backend passes on: a Hub id's resolved snapshot folder
(``model``), ``model.tokenizer`` (``tokenizer``)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from batchjob.config import EngineConfig, ModelConfig

from .vllm_kit import backend_config, build_model, needs_vllm

pytestmark = needs_vllm
REV = "0123456789abcdef0123456789abcdef01234567"


def test_a_hub_id_reaches_vllm_as_its_snapshot_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchjob.backends.vllm.engine_args import engine_settings

    model = build_model(tmp_path / "m")
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    shutil.copytree(model, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)

    hub_model = ModelConfig(path="org/tiny").with_hub_snapshots()
    s = engine_settings(backend_config(hub_model), "float32", 64)
    assert s.kwargs["model"] == str(repo / "snapshots" / REV)
    assert "tokenizer" not in s.kwargs  # vLLM reads the model's own
    cfg = backend_config(ModelConfig(path=model, tokenizer="org/tiny").with_hub_snapshots())
    assert engine_settings(cfg, "float32", 64).kwargs["tokenizer"] == str(repo / "snapshots" / REV)


def test_quantization_reaches_vllm_from_the_job_or_the_checkpoint(tmp_path: Path) -> None:
    import json

    from batchjob.backends.vllm.engine_args import engine_settings
    from batchjob.errors import ConfigError

    model = build_model(tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    plain = engine_settings(backend_config(ModelConfig(path=model)), "float32", 64)
    assert "quantization" not in plain.kwargs  # vLLM reads config.json's quantization_config
    s = engine_settings(backend_config(ModelConfig(path=model, quantization="awq")), "float32", 64)
    assert s.kwargs["quantization"] == "awq"
    both = backend_config(ModelConfig(path=model, quantization="awq"))
    extra = EngineConfig(backend="vllm", vllm={"quantization": "awq"})
    both = dataclasses.replace(both, engine=extra)
    with pytest.raises(ConfigError, match=r"model\.quantization or this, not both"):
        engine_settings(both, "float32", 64)
