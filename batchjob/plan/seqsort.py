"""Lexicographic sort of many token sequences, with the LCP of sorted neighbours.

MSD refinement over *buckets*: runs of rows (contiguous in the output order) known to share
their first ``depth`` tokens. One round, for all buckets at once:

1. extend: find how many more tokens all rows of a bucket share. Each row is compared with
   the previous row of its bucket in windows of ``W`` tokens (``W`` doubles up to a cap while
   a whole bucket still matches), vectorised over rows: one fancy-indexing call gathers
   ``W`` contiguous tokens per row.
2. split: stable-sort each bucket's rows by their token at the extended depth (rows that end
   there first). Runs of one row are final; a run of ended rows is a set of identical
   prompts (final); every other run becomes a bucket one token deeper. Two neighbouring runs
   share exactly ``depth`` tokens: that is their LCP.

Every shared token is compared about once (plus at most one window of overshoot per bucket
and round) and a row takes part in one round per branching point on its path, so the
element work is O(total tokens) and the number of numpy rounds is the height of the tree.
Ties (identical prompts) keep their input order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_W0 = 16  # first comparison window (tokens)
_WMAX = 256  # window cap: beyond it, extension advances linearly
_CHUNK = 1 << 21  # tokens gathered per block (bounds the temporary memory to ~20 MB)
_KEY_SHIFT = np.int64(1) << 33  # split key = bucket * 2^33 + (token + 2^31 + 1), 0 = ended


@dataclass(frozen=True)
class SortedSequences:
    """Prompts in lexicographic token order and the LCP of each sorted neighbour pair."""

    order: np.ndarray  # int64 [N]: prompt positions, lexicographic (a prefix sorts first)
    lcp: np.ndarray  # int64 [N]: lcp[i] = LCP(order[i-1], order[i]); lcp[0] = 0


class _Windows:
    """Gathers ``W`` consecutive tokens starting at many positions (past the end: junk).

    A window is one item of a void dtype ``4 * W`` bytes wide laid over the token buffer with
    a 4-byte stride, so fancy indexing copies each window with one memcpy.
    """

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens  # int32, contiguous
        self.tail_start = max(0, len(tokens) - _WMAX)
        # tail: the last tokens padded, so windows that run off the end stay in bounds
        tail = [self.tokens[self.tail_start :], np.zeros(_WMAX, self.tokens.dtype)]
        self.tail = np.concatenate(tail)

    @staticmethod
    def _view(arr: np.ndarray, width: int) -> np.ndarray:
        """[len(arr) - width + 1] void items: item i = arr[i : i + width]."""
        size = arr.itemsize
        shape = (len(arr) - width + 1,)
        return np.ndarray(shape, np.dtype(f"V{size * width}"), arr.data, strides=(size,))

    def gather(self, starts: np.ndarray, width: int) -> np.ndarray:
        """[R, width] tokens: tokens[starts[r] : starts[r] + width] for each r."""
        n_tok = len(self.tokens)
        fast = starts <= n_tok - width
        if width <= n_tok and fast.all():
            out = self._view(self.tokens, width)[starts]
        else:
            out = np.empty(len(starts), np.dtype(f"V{self.tokens.itemsize * width}"))
            if width <= n_tok:
                out[fast] = self._view(self.tokens, width)[starts[fast]]
            slow = ~fast
            out[slow] = self._view(self.tail, width)[starts[slow] - self.tail_start]
        return out.view(self.tokens.dtype).reshape(len(starts), width)

    def mismatch_prev(self, starts: np.ndarray, width: int) -> np.ndarray:
        """int64 [R]: first j < width where the windows at starts[i] and starts[i-1] differ,
        else width (width for i = 0). One gather per window, overlapping chunks by one row."""
        out = np.full(len(starts), width, dtype=np.int64)
        step = max(2, _CHUNK // width)
        for i in range(1, len(starts), step - 1):
            win = self.gather(starts[i - 1 : i + step - 1], width)  # [r + 1, width] int32
            pairs = win.view(np.int64)  # [r + 1, width / 2]: compare two tokens at a time
            ne = pairs[1:] != pairs[:-1]
            k = ne.argmax(axis=1)  # first differing pair (0 where none: masked below)
            r = np.arange(len(k))
            tok = 2 * k + (win[1:][r, 2 * k] == win[:-1][r, 2 * k])  # first token of the pair
            out[i : i + len(k)] = np.where(ne[r, k], tok, width)
        return out


def _run_starts(keys: np.ndarray) -> np.ndarray:
    """Indices where a run of equal keys starts (keys grouped)."""
    return np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))


def _ragged_arange(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    total = int(sizes.sum())
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(total, dtype=np.int64) - seg)


def _extend(
    win: _Windows,
    offsets: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    bucket: np.ndarray,
    depth: np.ndarray,
) -> np.ndarray:
    """Depth of each bucket after extending it to the LCP of all its rows.

    rows/bucket: the active rows grouped by bucket id; depth: [B] tokens already known to be
    shared. The LCP of a set is the minimum LCP of neighbours in any listing of it, so each
    row is compared with the previous row of its bucket.
    """
    depth = depth.copy()
    width = _W0
    while rows.size:
        d = depth[bucket]
        rem = lengths[rows] - d
        m = win.mismatch_prev(offsets[rows] + d, width)
        starts = _run_starts(bucket)
        prev_rem = np.concatenate([[width], rem[:-1]])
        m = np.minimum(np.minimum(m, rem), np.minimum(prev_rem, width))
        m[starts] = np.minimum(rem[starts], width)  # a bucket's first row: no predecessor
        m_bucket = np.minimum.reduceat(m, starts)
        ids = bucket[starts]
        depth[ids] += m_bucket
        more = m_bucket == width  # the whole bucket matched the window: look further
        if not more.any():
            break
        keep = np.repeat(more, np.diff(np.append(starts, len(rows))))
        rows, bucket = rows[keep], bucket[keep]
        width = min(2 * width, _WMAX)
    return depth


def sort_sequences(tokens: np.ndarray, offsets: np.ndarray) -> SortedSequences:
    """Sort rows ``tokens[offsets[i]:offsets[i+1]]`` lexicographically; neighbour LCPs."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    order = np.arange(n, dtype=np.int64)
    lcp = np.zeros(n, dtype=np.int64)
    if n <= 1:
        return SortedSequences(order=order, lcp=lcp)
    lengths = np.diff(offsets)
    if len(tokens) == 0:  # all rows empty: identical, input order
        return SortedSequences(order=order, lcp=lcp)
    win = _Windows(tokens)
    last = max(len(tokens) - 1, 0)
    # active buckets: first output slot, size, shared depth
    b_start = np.zeros(1, dtype=np.int64)
    b_size = np.array([n], dtype=np.int64)
    b_depth = np.zeros(1, dtype=np.int64)
    while b_start.size:
        slots = _ragged_arange(b_start, b_size)
        bucket = np.repeat(np.arange(len(b_start), dtype=np.int64), b_size)
        rows = order[slots]
        depth = _extend(win, offsets, lengths, rows, bucket, b_depth)
        d = depth[bucket]
        ended = lengths[rows] <= d
        tok = tokens[np.minimum(offsets[rows] + d, last)].astype(np.int64) + (1 << 31) + 1
        key = bucket * _KEY_SHIFT + np.where(ended, 0, tok)
        perm = np.argsort(key, kind="stable")  # buckets stay in place: bucket ids ascend
        rows, key, ended = rows[perm], key[perm], ended[perm]
        order[slots] = rows
        # boundaries inside a bucket between two runs, or inside a run of ended rows
        same_bucket = bucket[1:] == bucket[:-1]
        cut = same_bucket & ((key[1:] != key[:-1]) | ended[1:])
        lcp[slots[1:][cut]] = d[1:][cut]
        starts = _run_starts(key)
        sizes = np.diff(np.append(starts, len(key)))
        keep = (sizes >= 2) & ~ended[starts]
        b_start, b_size = slots[starts[keep]], sizes[keep]
        b_depth = d[starts[keep]] + 1
    return SortedSequences(order=order, lcp=lcp)
