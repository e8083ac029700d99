"""``n`` samples per prompt (``sampling.n``, ``input.n_column``): each row becomes ``n``
requests with the same prompt and ``sample_index`` 0..n-1.

The copies are ordinary prompts to the planner: identical prompts share all but their last
token, so the prefix tree puts a row's samples in one group whose prefix is computed once (and
a row whose prompt shares a prefix with others keeps sharing it). The sampler seeds sample
``k`` of a row with ``seed + k`` (vLLM seeds its ``n`` child requests the same way), so sample
0 equals the ``n = 1`` output and every sample is reproducible on its own, resumed or not.
"""

from __future__ import annotations

import numpy as np

from batchjob.tokenize.prompts import TokenizedPrompts

_UNSET = -1  # RowSettings.n: the row takes the job's sampling.n


def sample_counts(prompts: TokenizedPrompts, n: int) -> np.ndarray:
    """int64 [N]: how many samples each prompt's row asks for (its ``n_column`` value, else
    the job's ``n``)."""
    counts = np.full(len(prompts), n, dtype=np.int64)
    settings = prompts.settings
    if settings is None or settings.n is None or not len(prompts):
        return counts
    own = settings.n[np.searchsorted(settings.row_ids, prompts.row_ids)]
    return np.where(own == _UNSET, counts, own)


def expand_samples(prompts: TokenizedPrompts, n: int, per_row: bool = False) -> TokenizedPrompts:
    """Each prompt repeated by its sample count, samples of a row adjacent (sample 0 first),
    ``sample_index`` set. ``n == 1`` without ``per_row`` (no ``n_column``): ``prompts``
    unchanged (no ``sample_index``)."""
    if n == 1 and not per_row:
        return prompts
    counts = sample_counts(prompts, n)
    pos = np.repeat(np.arange(len(prompts), dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    out = prompts.take(pos)
    index = (np.arange(len(pos), dtype=np.int64) - first).astype(np.int32)
    return TokenizedPrompts(
        row_ids=out.row_ids,
        tokens=out.tokens,
        offsets=out.offsets,
        max_tokens=out.max_tokens,
        settings=out.settings,
        sample_index=index,
        adapter=out.adapter,
    )
