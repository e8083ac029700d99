"""The Backend contract is an abstract class that every backend implements in full: the
pipeline calls its methods directly (no optional method found by ``getattr``), so a rule it
applies through them (a row over the KV budget is reported, the rest runs) holds on each.
The rule itself is tested end to end: native in tests/e2e/test_errors.py, vLLM beside native
in tests/backends/vllm/test_vllm_pipeline.py."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
from pathlib import Path

import pytest

from batchjob.backends.base import Backend

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = {"rows_over_budget", "check_fits", "run", "close"}


def test_backend_is_an_abc_of_the_methods_the_pipeline_calls():
    assert inspect.isabstract(Backend)
    assert Backend.__abstractmethods__ == CONTRACT


def test_native_backend_implements_the_whole_contract():
    from batchjob.backends.native.backend import NativeBackend

    assert issubclass(NativeBackend, Backend) and not inspect.isabstract(NativeBackend)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_backend_implements_the_whole_contract():
    from batchjob.backends.vllm.backend import VllmBackend

    assert issubclass(VllmBackend, Backend) and not inspect.isabstract(VllmBackend)


def test_the_runner_probes_no_backend_attribute():
    grep = ["grep", "-rn", r"getattr(.*backend", "batchjob/runner", "batchjob/api.py"]
    found = subprocess.run(grep, cwd=ROOT, capture_output=True, text=True).stdout
    assert found == "", found
