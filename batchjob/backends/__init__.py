"""Engines that execute a plan, behind one interface (``base.Backend``), chosen by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchjob.backends.names import BACKENDS

if TYPE_CHECKING:
    from batchjob.backends.base import Backend, Detokenize
    from batchjob.config import JobConfig


def open_backend(job: JobConfig, detokenize: Detokenize) -> Backend:
    """The backend of ``job.engine.backend``, loaded and ready to ``run``."""
    name = job.engine.backend
    if name == "native":
        from batchjob.backends.native.backend import NativeBackend

        return NativeBackend(job, detokenize)
    if name == "vllm":
        from batchjob.backends.vllm.backend import VllmBackend

        return VllmBackend(job, detokenize)
    raise ValueError(f"unknown backend {name!r} (use {', '.join(BACKENDS)})")
