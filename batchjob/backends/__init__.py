"""Engines that execute a plan, behind one interface (``base.Backend``), chosen by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchjob.backends.names import BACKENDS

if TYPE_CHECKING:
    from batchjob.backends.base import Backend, BackendConfig, Detokenize
    from batchjob.model.info import ModelInfo


def open_backend(
    cfg: BackendConfig, detokenize: Detokenize, model: ModelInfo | None = None
) -> Backend:
    """The backend of ``cfg.engine.backend``, loaded and ready to ``run``.

    ``model``: the job's model folder as ``load_prompts`` read it (read here if None).
    """
    name = cfg.engine.backend
    if name == "native":
        from batchjob.backends.native.backend import NativeBackend

        return NativeBackend(cfg, detokenize, model)
    if name == "vllm":
        from batchjob.backends.vllm.backend import VllmBackend

        return VllmBackend(cfg, detokenize, model)
    raise ValueError(f"unknown backend {name!r} (use {', '.join(BACKENDS)})")
