"""Execution order of groups (BatchLLM Eq. 3-4).

The paper schedules requests with a larger decode/prefill ratio first (Eq. 3), so that long
decodes start early and later prefill chunks can mix with them. With the decode length
normalised to a constant it ranks groups by R_group = 1 / (L_prefix + sum L_distinct)
(Eq. 4). We keep the per-row decode estimate (``max_tokens``) instead of the constant:

    R_group = sum_{m in group} decode_m / (prefix_len + sum_{m in group} (len_m - prefix_len))

which is Eq. 4 times the constant when every estimate is equal. Larger R_group runs first;
ties go to the group whose first member (lowest prompt position) comes first in the input.
"""

from __future__ import annotations

import numpy as np


def group_order(
    prefix_len: np.ndarray,
    group_offsets: np.ndarray,
    members: np.ndarray,
    lengths: np.ndarray,
    decode: np.ndarray,
    *,
    by_ratio: bool = True,
) -> np.ndarray:
    """Permutation of groups: Eq. 4 order (by_ratio) or input order of their first member.

    members must be grouped by ``group_offsets`` and ascending by position within a group.
    lengths, decode: by prompt position.
    """
    num = len(prefix_len)
    first = members[group_offsets[:-1]] if num else np.zeros(0, dtype=np.int64)
    if not by_ratio:
        return np.argsort(first, kind="stable")
    sizes = np.diff(group_offsets)
    seg = np.repeat(np.arange(num), sizes)
    prompt_tokens = np.bincount(seg, weights=lengths[members], minlength=num)
    decode_sum = np.bincount(seg, weights=decode[members], minlength=num)
    prefill = prompt_tokens - (sizes - 1) * prefix_len  # prefix once + distinct parts
    ratio = decode_sum / np.maximum(prefill, 1)
    return np.lexsort((first, -ratio))
