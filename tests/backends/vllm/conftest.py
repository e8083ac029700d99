"""The tiny model and small dataset every vLLM backend test module shares (built once)."""

from __future__ import annotations

import pytest

from tests.backends.vllm.vllm_kit import build_dataset, build_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("vllm-model") / "tiny")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    return build_dataset(tmp_path_factory.mktemp("vllm-data") / "p.parquet", scale=0.01)
