"""TritonAttention: the engine-facing Triton backend (same methods as TorchAttention)."""

from __future__ import annotations

import torch

from batchjob.backends.native.attention.base import BatchMemo
from batchjob.kernels.triton.wrappers import (
    VARIANTS,
    Workspace,
    group_order,
    prefix_attention,
    write_kv,
)


class TritonAttention:
    """Prefix-shared paged attention with Triton kernels.

    ``variant="fused"`` (default) runs prefix part, own part and merge in one launch;
    ``"cascade"`` uses three launches (for comparison). The instance owns a reusable
    workspace and caches per-batch derived metadata across layers (keyed on the metadata
    object's identity), so use one instance per stream. Argument types: AttentionBackend.
    """

    name = "triton"

    def __init__(self, variant: str = "fused") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
        self.variant = variant
        self._workspace = Workspace()
        self._order = BatchMemo()

    # k, v: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping
    write_kv = staticmethod(write_kv)

    def attend(self, q, k_cache, v_cache, meta, scale, out=None) -> torch.Tensor:
        order = self._order.get(meta, (), lambda: group_order(meta))  # once per batch
        return prefix_attention(
            q, k_cache, v_cache, meta, scale,
            variant=self.variant, workspace=self._workspace, order=order, out=out,
        )  # fmt: skip
