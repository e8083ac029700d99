"""batchjob: offline batch LLM inference for prefix-shared Parquet datasets.

``batchjob.run(job)`` runs a job file as ``batchjob run`` does; ``batchjob.generate(data,
model=..., sampling={...})`` runs a pyarrow Table, a polars or pandas DataFrame or a list of
prompts and returns a pyarrow Table; ``batchjob.Generator`` keeps one loaded engine across
calls; ``batchjob.generate_batches`` streams data larger than memory (``batchjob.api``).
Imported lazily: ``import batchjob`` loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchjob.version import __version__ as __version__

if TYPE_CHECKING:
    from batchjob.api import Generator as Generator
    from batchjob.api import generate as generate
    from batchjob.api import generate_batches as generate_batches
    from batchjob.api import run as run

_API = ("run", "generate", "generate_batches", "Generator")
__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        from batchjob import api

        return getattr(api, name)
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
