"""What every attention backend implements, and the per-batch memo they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np
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
        window: int | None = None,  # sliding window: a query sees the last W positions' keys
    ) -> torch.Tensor: ...  # [T, H, D], q's dtype


def window_applies(meta: AttentionMetadata, window: int | None) -> bool:
    """Whether a sliding window hides any key from any query of this batch (host ints only:
    a sequence's positions are below its prefix + own KV)."""
    return window is not None and meta.max_prefix_len + meta.max_kv_len > window


def seq_arrays(meta: AttentionMetadata) -> tuple[np.ndarray, ...]:
    """int64 host copies per sequence: cu_q [S + 1], q_len, kv_len, and the length of the
    group prefix before its own KV (0 outside a group), each [S]."""
    cu_q = meta.cu_q.cpu().numpy().astype(np.int64)
    kv_len = meta.kv_len.cpu().numpy().astype(np.int64)
    group = meta.seq_group.cpu().numpy().astype(np.int64)
    p_len = meta.prefix_len.cpu().numpy().astype(np.int64)
    prefix = np.where(group >= 0, p_len[np.maximum(group, 0)] if len(p_len) else 0, 0)
    return cu_q, np.diff(cu_q), kv_len, prefix


def token_positions(meta: AttentionMetadata) -> np.ndarray:
    """int64 [T]: each query token's absolute position (its group's prefix, then own KV)."""
    cu_q, q_len, kv_len, prefix = seq_arrays(meta)
    first = prefix + kv_len - q_len  # position of each sequence's first query token
    seq = np.repeat(np.arange(len(q_len)), q_len)
    return first[seq] + np.arange(int(cu_q[-1])) - cu_q[:-1][seq]


class BatchMemo:
    """The work a backend derives from one batch's metadata, built once per key (layers with
    and without a sliding window differ) and reused by every layer (the same
    ``AttentionMetadata`` object) until the next batch."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._values: dict[tuple, object] = {}

    def get(self, meta: AttentionMetadata, key: tuple, build: Callable[[], T]) -> T:
        if self._meta is not meta:
            self._meta, self._values = meta, {}
        if key not in self._values:
            self._values[key] = build()
        return self._values[key]  # type: ignore[return-value]


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into the caller's ``out`` when one was given (``attend(out=...)``
    for backends whose kernels write a tensor of their own)."""
    return result if out is None else out.copy_(result)
