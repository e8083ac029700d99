"""Triton kernels for prefix-shared paged attention.

On CUDA tensors the kernels compile and autotune; on CPU tensors they run under Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was first imported (tests).
Importing this package does not import triton.
"""

from __future__ import annotations

from .variants import UnsharedKV, plain_paged_attention, unshare_kv
from .wrappers import (
    VARIANTS,
    AttentionPlan,
    Workspace,
    cascade_prefix_attention,
    fused_prefix_attention,
    group_order,
    paged_attention,
    plan_attention,
    prefix_attention,
    write_kv,
)

__all__ = [
    "VARIANTS",
    "AttentionPlan",
    "UnsharedKV",
    "Workspace",
    "cascade_prefix_attention",
    "fused_prefix_attention",
    "group_order",
    "paged_attention",
    "plain_paged_attention",
    "plan_attention",
    "prefix_attention",
    "unshare_kv",
    "write_kv",
]
