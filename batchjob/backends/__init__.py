"""Engines that execute a plan, behind one interface (``base.Backend``), chosen by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchjob.backends.names import BACKENDS

if TYPE_CHECKING:
    from batchjob.backends.base import Backend, Detokenize
    from batchjob.config import JobConfig
    from batchjob.model.info import ModelInfo


def open_backend(job: JobConfig, detokenize: Detokenize, model: ModelInfo | None = None) -> Backend:
    """The backend of ``job.engine.backend``, loaded and ready to ``run``.

    ``model``: the job's model folder as ``load_prompts`` read it (read here if None).
    """
    name = job.engine.backend
    if name == "native":
        from batchjob.backends.native.backend import NativeBackend

        return NativeBackend(job, detokenize, model)
    if name == "vllm":
        from batchjob.backends.vllm.backend import VllmBackend

        return VllmBackend(job, detokenize, model)
    raise ValueError(f"unknown backend {name!r} (use {', '.join(BACKENDS)})")
