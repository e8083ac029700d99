"""The worker extension that loads batchjob's prefix-shared attention in vLLM's worker.

``engine_args`` names ``PrefixAttentionWorker`` as vLLM's ``worker_extension_cls`` on the CPU;
vLLM imports this module in the worker process before it builds the model, and the import
registers ``prefix_attention.PrefixSharedCpuBackend`` as vLLM's CPU attention. Should the
installed vLLM lack what that backend subclasses (a vLLM other than the tested 0.32), the
worker logs why and keeps vLLM's own attention: the job runs, only without the shared reads.
"""

from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    try:
        from batchjob.backends.vllm import prefix_attention
    except (ImportError, AttributeError) as e:
        log.warning("batchjob prefix-shared attention not loaded (vLLM's own runs): %s", e)
        return None
    prefix_attention.register()
    return prefix_attention


_MODULE = _load()


class PrefixAttentionWorker:
    """Mixed into vLLM's worker class; the driver reads the counts through
    ``LLMEngine.collective_rpc("batchjob_prefix_attention_stats")``."""

    def batchjob_prefix_attention_stats(self) -> dict[str, int]:
        return dict(_MODULE.STATS) if _MODULE is not None else {}
