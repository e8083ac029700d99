"""The architecture config the native ``nn.Module`` is built from.

Parsed torch-free by ``batchjob.model.hf_config`` (called by ``batchjob.model.info``, the one reader
of config.json); re-exported here for the model code.
"""

from __future__ import annotations

from batchjob.model.hf_config import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    RopeConfig,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfig", "RopeConfig"]
