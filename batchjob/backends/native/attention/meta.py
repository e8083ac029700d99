"""The batch contract between the engine and every attention backend (defined in kernels/)."""

from batchjob.kernels.meta import AttentionMetadata

__all__ = ["AttentionMetadata"]
