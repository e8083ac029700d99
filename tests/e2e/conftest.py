"""Fixtures of the end-to-end tests: one tiny model and one small dataset per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.jobkit import build_dataset, build_model


@pytest.fixture(scope="session")
def run_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("run-model") / "tiny")


@pytest.fixture(scope="session")
def run_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dataset(tmp_path_factory.mktemp("run-data") / "prompts.parquet")
