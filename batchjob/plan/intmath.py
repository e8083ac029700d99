"""Integer helpers shared by the planner and the engine. Stdlib only (no torch, no numpy).

kernels/ keeps its own one-line ``cdiv`` since it may import nothing from batchjob.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

# ints, numpy arrays and torch tensors all floor-divide elementwise
N = TypeVar("N", int, "np.ndarray", "torch.Tensor")


def cdiv(a: N, b: int) -> N:
    """Ceiling of ``a / b`` for ``b > 0``: the number of size-``b`` blocks holding ``a`` items."""
    return -(-a // b)
