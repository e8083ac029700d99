"""Triton kernels for prefix-shared paged attention (imported as batchjob.kernels).

On CUDA tensors the kernels compile and autotune; on CPU tensors they run under Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was first imported (tests).
Importing this package does not import triton. See docs/kernels.md.
"""

from __future__ import annotations

from .backend import TritonAttention
from .variants import UnsharedKV, plain_paged_attention, unshare_kv
from .wrappers import (
    Workspace,
    cascade_prefix_attention,
    fused_prefix_attention,
    group_order,
    paged_attention,
    write_kv,
)

__all__ = [
    "TritonAttention",
    "UnsharedKV",
    "Workspace",
    "cascade_prefix_attention",
    "fused_prefix_attention",
    "group_order",
    "paged_attention",
    "plain_paged_attention",
    "unshare_kv",
    "write_kv",
]
