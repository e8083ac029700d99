"""TritonAttention: the engine-facing Triton backend (same methods as TorchAttention)."""

from __future__ import annotations

import torch

from batchjob.backends.native.attention.base import BatchMemo, window_applies
from batchjob.backends.native.attention.torch_path import TorchAttention
from batchjob.kernels.triton.wrappers import (
    VARIANTS,
    Workspace,
    check_write_kv,
    choose_variant,
    kv_signature,
    plan_attention,
    write_kv,
)


class TritonAttention:
    """Prefix-shared paged attention with Triton kernels.

    ``variant="auto"`` (default) picks per batch (``choose_variant``: fused for decode-only
    batches, cascade with prefill chunks); ``"fused"`` always runs prefix part, own part and
    merge in one launch, ``"cascade"`` in three. The instance owns a reusable
    workspace and checks and derives each batch once for all its layers (an
    ``AttentionPlan``, kept while the metadata object and the layers' shapes stay the same):
    a layer's host work is its launch. One instance per stream. Argument types:
    AttentionBackend.
    """

    name = "triton"

    def __init__(self, variant: str = "auto") -> None:
        if variant != "auto" and variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {('auto', *VARIANTS)}")
        self.variant = variant
        self._workspace = Workspace()
        self._plan = BatchMemo()
        self._kv_checked: tuple = ()  # (signature, slot_mapping) of the last checked write
        self._windowed = TorchAttention()  # batches a sliding window hides keys in

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        """k, v: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping;
        checked once per batch (the same slot_mapping and layer shapes)."""
        sig = kv_signature(k_cache, v_cache, k, v)
        done = self._kv_checked
        if not (done and done[0] == sig and done[1] is slot_mapping):
            check_write_kv(k_cache, v_cache, k, v, slot_mapping)
            self._kv_checked = (sig, slot_mapping)
        write_kv(k_cache, v_cache, k, v, slot_mapping, checked=True)

    def attend(self, q, k_cache, v_cache, meta, scale, out=None, window=None) -> torch.Tensor:
        if window_applies(meta, window):  # the kernels have no window: torch's dense path
            return self._windowed.attend(q, k_cache, v_cache, meta, scale, out, window)
        key = (q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(), scale)
        variant = choose_variant(meta) if self.variant == "auto" else self.variant
        plan = self._plan.get(
            meta,
            key,
            lambda: plan_attention(
                q, k_cache, v_cache, meta, scale, variant=variant, workspace=self._workspace
            ),
        )
        return plan.run(q, k_cache, v_cache, out)  # checks q and the caches against the plan
