"""The optional extras bring what their documented recipes import: ``batchjob[ray]`` runs
docs/migrating.md's Ray Data recipe, and ``import ray.data`` needs pandas (``ray``, not
``ray[data]``, is pinned)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def extra(name: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["optional-dependencies"][name]
    return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0] for r in reqs}


def test_the_ray_extra_brings_what_ray_data_needs() -> None:
    assert {"ray", "pandas"} <= extra("ray")
    assert {"ray", "pandas"} <= extra("dev")  # make install: the recipe's integration test
    assert "map_batches(Generate" in (ROOT / "docs" / "migrating.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_data_imports_with_the_extra_installed() -> None:
    r = subprocess.run(
        [sys.executable, "-c", "import ray.data, pandas"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
