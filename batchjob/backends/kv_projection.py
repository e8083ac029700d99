"""Projected KV peak of requests still decoding: the decode-growth reserve both batchllm
schedulers (native and vLLM) admit new prefill against. numpy only: no torch, no vllm."""

from __future__ import annotations

import numpy as np

from batchjob.plan.intmath import cdiv


def projected_peak_blocks(
    tokens: np.ndarray, remaining: np.ndarray, shared: np.ndarray, block_size: int
) -> int:
    """Peak over future steps of the blocks requests own if each grows by one token a step
    from ``tokens`` to ``tokens + remaining`` and then frees its blocks (all but ``shared``,
    a group prefix held elsewhere). The peak is just before some request finishes, so only
    those steps are evaluated: the decode-growth reserve without assuming that every request
    reaches its maximum length at the same time."""
    if len(tokens) == 0:
        return 0
    steps = np.unique(remaining) - 1  # [T]
    alive = remaining[None, :] > steps[:, None]  # [T, N]
    own = cdiv(tokens[None, :] + steps[:, None], block_size) - shared[None, :]
    return int(np.where(alive, np.maximum(own, 0), 0).sum(axis=1).max())


def prefix_peaks(
    tokens: np.ndarray, remaining: np.ndarray, shared: np.ndarray, block_size: int
) -> np.ndarray:
    """``projected_peak_blocks`` of the first m requests for every m = 1 .. N, in one pass
    (the vLLM scheduler's admission asks it of every prefix of its candidates). Evaluated at
    the finish steps of all N: between two finish steps of its own a prefix's load only grows,
    so the extra steps never raise its maximum. Nondecreasing in m."""
    if len(tokens) == 0:
        return np.zeros(0, np.int64)
    steps = np.unique(remaining) - 1  # [T]
    alive = remaining[None, :] > steps[:, None]  # [T, N]
    own = cdiv(tokens[None, :] + steps[:, None], block_size) - shared[None, :]
    load = np.where(alive, np.maximum(own, 0), 0)
    return np.cumsum(load, axis=1).max(axis=0).astype(np.int64)
