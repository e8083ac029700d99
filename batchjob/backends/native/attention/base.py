"""What every attention backend implements, and the per-batch memo they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from batchjob.backends.native.attention.meta import AttentionMetadata

T = TypeVar("T")


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, H, D], q's dtype: written and returned
    ) -> torch.Tensor: ...  # [T, H, D], q's dtype


class BatchMemo:
    """The work a backend derives from one batch's metadata, built once and reused by every
    layer (the same ``AttentionMetadata`` object) until the next batch."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._key: tuple = ()
        self._value: object = None

    def get(self, meta: AttentionMetadata, key: tuple, build: Callable[[], T]) -> T:
        if self._meta is not meta or self._key != key:
            self._meta, self._key, self._value = meta, key, build()
        return self._value  # type: ignore[return-value]


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into the caller's ``out`` when one was given (``attend(out=...)``
    for backends whose kernels write a tensor of their own)."""
    return result if out is None else out.copy_(result)
