"""Tokenized prompts: the boundary between reading/tokenizing and planning/executing.

Columnar on purpose: one flat int32 token array plus offsets scales to millions of rows
without a Python object per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from batchjob.config.sections import MAX_SAMPLES

if TYPE_CHECKING:
    from batchjob.inputs.row_settings import RowSettings


@dataclass(frozen=True)
class TokenizedPrompts:
    """N prompts as one flat token array.

    Row i's tokens are ``tokens[offsets[i]:offsets[i + 1]]``. Only rows that are valid
    (status ok) appear here; rows rejected per-row are reported by the reader separately.
    """

    row_ids: np.ndarray  # int64 [N]: stable row id of each prompt in the input dataset
    tokens: np.ndarray  # int32 [offsets[-1]]: all prompt tokens, row after row
    offsets: np.ndarray  # int64 [N + 1]: row i is tokens[offsets[i]:offsets[i+1]]
    max_tokens: np.ndarray  # int32 [N]: decode limit per row (the job default where unset)
    settings: RowSettings | None = None  # per-row sampling/labels, keyed by row_id
    # int32 [N]: which sample of its row each prompt is (sampling.n); None: one sample per row
    sample_index: np.ndarray | None = None
    # int32 [N]: the LoRA adapter each prompt runs with (its index in model.adapters, -1:
    # the base model); None: every prompt runs on the base model
    adapter: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.row_ids)
        if self.adapter is not None and self.adapter.shape != (n,):
            raise ValueError(f"adapter must have shape ({n},), got {self.adapter.shape}")
        if self.sample_index is not None and self.sample_index.shape != (n,):
            raise ValueError(f"sample_index must have shape ({n},), got {self.sample_index.shape}")
        if self.offsets.shape != (n + 1,):
            raise ValueError(f"offsets must have shape ({n + 1},), got {self.offsets.shape}")
        if self.max_tokens.shape != (n,):
            raise ValueError(f"max_tokens must have shape ({n},), got {self.max_tokens.shape}")
        if n and (self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens)):
            raise ValueError("offsets must start at 0 and end at len(tokens)")

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [N]: prompt length of each row."""
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        """Tokens of the i-th prompt (a view, not a copy)."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def samples(self) -> np.ndarray:
        """int32 [N]: the sample index of each prompt (all 0 with one sample per row)."""
        if self.sample_index is None:
            return np.zeros(len(self), dtype=np.int32)
        return self.sample_index

    @property
    def keys(self) -> np.ndarray:
        """int64 [N]: each prompt's result key (``request_keys``): unique per (row, sample)."""
        return request_keys(self.row_ids, self.samples)

    def take(self, which: np.ndarray) -> TokenizedPrompts:
        """The prompts at positions ``which`` (int, in that order, repeats allowed) or whose
        flag is set (bool [N]); tokens copied compactly, settings kept (keyed by row_id)."""
        which = np.asarray(which)
        pos = np.flatnonzero(which) if which.dtype == bool else which.astype(np.int64)
        lengths = self.lengths[pos]
        offsets = np.zeros(len(pos) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        seg = np.repeat(offsets[:-1], lengths)
        src = np.repeat(self.offsets[:-1][pos], lengths) + (np.arange(offsets[-1]) - seg)
        return TokenizedPrompts(
            row_ids=self.row_ids[pos],
            tokens=self.tokens[src],
            offsets=offsets,
            max_tokens=self.max_tokens[pos],
            settings=self.settings,
            sample_index=None if self.sample_index is None else self.sample_index[pos],
            adapter=None if self.adapter is None else self.adapter[pos],
        )

    @classmethod
    def from_lists(
        cls,
        seqs: list[list[int]] | list[np.ndarray],
        row_ids: np.ndarray | None = None,
        max_tokens: int | np.ndarray = 16,
    ) -> TokenizedPrompts:
        """Build from a list of token sequences (tests, small inputs)."""
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = (
            np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
            if len(seqs)
            else np.zeros(0, dtype=np.int32)
        )
        ids = np.arange(len(seqs), dtype=np.int64) if row_ids is None else np.asarray(row_ids)
        mt = np.broadcast_to(np.asarray(max_tokens, dtype=np.int32), (len(seqs),)).copy()
        return cls(row_ids=ids, tokens=tokens.astype(np.int32), offsets=offsets, max_tokens=mt)


def request_keys(row_ids: np.ndarray, sample_index: np.ndarray | None = None) -> np.ndarray:
    """int64 [N]: the key of each (row, sample) result, ``row_id * MAX_SAMPLES + sample``: what
    resume and the one-result-per-request checks compare (row ids below 2**47)."""
    keys = np.asarray(row_ids, dtype=np.int64) * MAX_SAMPLES
    if sample_index is not None:
        keys = keys + np.asarray(sample_index, dtype=np.int64)
    return keys


class _Growing:
    """A 1-D array appended to in place: ``np.empty`` pages become resident only when written,
    so a capacity above the need costs address space, not memory; a short one doubles."""

    def __init__(self, capacity: int, dtype: type):
        self._buf: np.ndarray = np.empty(max(int(capacity), 1024), dtype=dtype)
        self.size = 0

    def append(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), end), dtype=self._buf.dtype)
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : end] = values
        self.size = end

    def view(self) -> np.ndarray:
        return self._buf[: self.size]


class PromptsBuilder:
    """Builds ``TokenizedPrompts`` batch by batch straight into its flat arrays.

    Replaces collecting per-batch arrays and concatenating them at the end, which held every
    token twice at the peak. ``rows`` and ``tokens``: capacities, ideally upper bounds (the
    dataset's row count; a token-id column's value count from the Parquet metadata).
    """

    def __init__(self, rows: int, tokens: int):
        self._row_ids = _Growing(rows, np.int64)
        self._tokens = _Growing(tokens, np.int32)
        self._offsets = _Growing(rows + 1, np.int64)
        self._offsets.append(np.zeros(1, dtype=np.int64))
        self._max_tokens = _Growing(rows, np.int32)

    def add(
        self, row_ids: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, max_tokens: np.ndarray
    ) -> None:
        """Append rows (tokens: their prompts one after another, ``lengths`` each)."""
        base = self._tokens.size
        self._row_ids.append(row_ids)
        self._tokens.append(tokens)
        self._offsets.append(base + np.cumsum(lengths, dtype=np.int64))
        self._max_tokens.append(max_tokens)

    def build(self) -> TokenizedPrompts:
        return TokenizedPrompts(
            row_ids=self._row_ids.view(),
            tokens=self._tokens.view(),
            offsets=self._offsets.view(),
            max_tokens=self._max_tokens.view(),
        )
