"""Attention backends by name: one list used by config validation, errors and dispatch.

``load_job`` checks the name and what needs no device (``cpu`` with a cuda model.device,
``triton`` with a cpu one); what needs the machine fails here, a ``ConfigError`` naming
``engine.attention``.
"""

from __future__ import annotations

import os

import torch

from batchjob.backends.names import ATTENTION_BACKENDS
from batchjob.backends.native.attention.base import AttentionBackend
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.errors import ConfigError


def _triton_backend() -> AttentionBackend:
    try:
        from batchjob.backends.native.attention.triton import TritonAttention
    except ImportError as e:
        raise ConfigError(f"engine.attention: 'triton' is unavailable: {e}") from e
    return TritonAttention()


def _cpu_backend() -> AttentionBackend | None:
    """The C kernel backend, or None when it did not build."""
    from batchjob.backends.native.attention.cpu import CpuAttention

    backend = CpuAttention()
    return backend if backend.available else None


def get_attention_backend(
    name: str = "auto", device: str | torch.device = "cpu"
) -> AttentionBackend:
    """``torch``; ``cpu`` (the C kernel, ``attention_cpu.CpuAttention``); ``triton``
    (``batchjob.kernels.TritonAttention``, CUDA, or CPU under ``TRITON_INTERPRET=1``);
    ``auto``: triton on CUDA when it imports, the C kernel on CPU when it builds, else torch."""
    dev = torch.device(device)
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        if dev.type != "cpu":
            raise ConfigError(f"engine.attention: 'cpu' runs on the CPU only (got {dev})")
        backend = _cpu_backend()
        if backend is None:
            raise ConfigError("engine.attention: 'cpu': the C kernel did not build (see log)")
        return backend
    if name == "triton":
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"engine.attention: 'triton' needs a CUDA device (got {dev}); "
                "use 'torch' or 'auto' on CPU"
            )
        return _triton_backend()
    if name == "auto":
        if dev.type == "cuda":
            try:
                return _triton_backend()
            except ConfigError:
                pass
        if dev.type == "cpu":
            return _cpu_backend() or TorchAttention()
        return TorchAttention()
    names = ", ".join(ATTENTION_BACKENDS)
    raise ConfigError(f"engine.attention: unknown attention backend {name!r} (use {names})")
