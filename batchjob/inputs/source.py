"""The job's input, whatever its form: Parquet files (batchjob.inputs.parquet) or OpenAI Batch API
request lines (batchjob.inputs.openai_batch, for a ``.jsonl`` path).

The one place that chooses between them: openai_jsonl builds on io's dataset types, so io
itself cannot dispatch to it without an import cycle.
"""

from __future__ import annotations

from batchjob.config import InputConfig, ModelConfig, SamplingConfig
from batchjob.inputs.openai_batch import open_requests
from batchjob.inputs.parquet import InputDataset, open_dataset


def open_input(
    cfg: InputConfig, model: ModelConfig | None = None, sampling: SamplingConfig | None = None
) -> InputDataset:
    """Resolve and validate the input; reads no row data. ``model``: the job's model section,
    to load a chat template; ``sampling``: the job's, to check what OpenAI requests ask for
    (None: metadata only)."""
    if cfg.path.endswith(".jsonl"):
        return open_requests(cfg, model, sampling)
    return open_dataset(cfg, model)
