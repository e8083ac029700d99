"""Partitions of a dataset by its rows' leading tokens, spilled to disk.

Two rows whose first ``d`` tokens differ (or one of which has fewer than ``d`` tokens) share
at most ``d - 1`` tokens in the planning tree (the prompts without their last token), so
rows split by a key of their first ``d`` tokens can be planned apart, each partition on its
own; the split can lose only prefixes shorter than ``d`` tokens shared across partitions.

The key is a hash of (the first ``min(d, len)`` tokens, that count): a linear hash with one
random 64-bit weight per position, summed with one cumulative sum over the tokens (every
depth at once, O(tokens)), then mixed (splitmix64) and taken modulo the partition count.
Rows of equal keys always land together; a collision only plans two keys together.

``PartitionSpill`` appends rows batch by batch to two raw files per partition under a
folder: ``pNNNNN.rows`` (a record per row: position, row_id, length, max_tokens) and
``pNNNNN.tok`` (int32 tokens, row after row). ``position`` is the row's index among the
dataset's valid rows in input order: the prompt position the in-memory planner would give it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchjob.tokenize.prompts import TokenizedPrompts

FIRST_DEPTH = 4  # tokens in the key of the first split
DEPTHS = (8, 16, 32, 64, 128, 256, 512)  # deeper keys tried for a partition over its budget
ROW = np.dtype([("position", "<i8"), ("row_id", "<i8"), ("length", "<i8"), ("max_tokens", "<i4")])
_MAX_DEPTH = max(DEPTHS)
_WEIGHTS = (
    np.random.default_rng(0x5EED).integers(0, 2**63, size=_MAX_DEPTH, dtype=np.uint64) * 2 + 1
)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit reaches the low bits the modulo keeps."""
    h = h.copy()
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


def prefix_keys(tokens: np.ndarray, offsets: np.ndarray, depths: tuple[int, ...]) -> np.ndarray:
    """uint64 [len(depths), N]: each row's key at each depth (``tokens``/``offsets`` as in
    ``TokenizedPrompts``; depths at most ``max(DEPTHS)``)."""
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    top = min(max(depths), _MAX_DEPTH)
    # only each row's first ``top`` tokens take part
    keep = np.minimum(lengths, top)
    seg = np.repeat(np.arange(n), keep)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(keep, out=starts[1:])
    within = np.arange(int(starts[-1]), dtype=np.int64) - starts[:-1][seg]
    src = offsets[:-1][seg] + within
    with np.errstate(over="ignore"):
        w = (tokens[src].astype(np.int64).astype(np.uint64) + np.uint64(1)) * _WEIGHTS[within]
        cum = np.zeros(len(w) + 1, dtype=np.uint64)
        np.cumsum(w, out=cum[1:])
        out = np.empty((len(depths), n), dtype=np.uint64)
        for i, d in enumerate(depths):
            upto = np.minimum(keep, d)
            h = cum[starts[:-1] + upto] - cum[starts[:-1]]
            out[i] = _mix(h + upto.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return out


def partition_of(keys: np.ndarray, num_parts: int) -> np.ndarray:
    """int64: the partition of each key."""
    return (keys % np.uint64(num_parts)).astype(np.int64)


@dataclass(frozen=True)
class Rows:
    """Rows of one partition (or a chunk of one): a record per row and their tokens."""

    rows: np.ndarray  # ROW [n]
    tokens: np.ndarray  # int32 [sum of lengths]

    @property
    def offsets(self) -> np.ndarray:
        off = np.zeros(len(self.rows) + 1, dtype=np.int64)
        np.cumsum(self.rows["length"], out=off[1:])
        return off

    def prompts(self) -> TokenizedPrompts:
        """The rows as prompts (positions in the partition; ``rows["position"]`` maps back)."""
        return TokenizedPrompts(
            row_ids=self.rows["row_id"].copy(),
            tokens=self.tokens,
            offsets=self.offsets,
            max_tokens=self.rows["max_tokens"].copy(),
        )


class PartitionSpill:
    """Rows appended by partition to files under ``folder`` (made if missing)."""

    def __init__(self, folder: Path, num_parts: int, depth: int = FIRST_DEPTH, name: str = "p"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_parts = num_parts
        self.depth = depth
        self.name = name
        self.num_rows = np.zeros(num_parts, dtype=np.int64)
        self.num_tokens = np.zeros(num_parts, dtype=np.int64)

    def path(self, part: int, kind: str) -> Path:
        return self.folder / f"{self.name}{part:05d}.{kind}"

    def add(self, chunk: Rows) -> None:
        """Append ``chunk``'s rows, each to its partition by its key at ``self.depth``."""
        if not len(chunk.rows):
            return
        offsets = chunk.offsets
        key = prefix_keys(chunk.tokens, offsets, (self.depth,))[0]
        self.add_to(chunk, offsets, partition_of(key, self.num_parts))

    def add_to(self, chunk: Rows, offsets: np.ndarray, part: np.ndarray) -> None:
        """Append ``chunk``'s rows to the partitions ``part`` (int64 [n]) names."""
        order = np.argsort(part, kind="stable")  # input order kept within a partition
        bounds = np.searchsorted(part[order], np.arange(self.num_parts + 1))
        lengths = chunk.rows["length"]
        for p in np.flatnonzero(np.diff(bounds)):
            idx = order[bounds[p] : bounds[p + 1]]
            tok = chunk.tokens[_ranges(offsets[:-1][idx], lengths[idx])]
            with open(self.path(int(p), "rows"), "ab") as f:
                chunk.rows[idx].tofile(f)
            with open(self.path(int(p), "tok"), "ab") as f:
                tok.astype(np.int32, copy=False).tofile(f)
            self.num_rows[p] += len(idx)
            self.num_tokens[p] += len(tok)

    def read(self, part: int) -> Rows:
        """The whole partition."""
        if not self.num_rows[part]:
            return Rows(np.zeros(0, dtype=ROW), np.zeros(0, dtype=np.int32))
        rows = np.fromfile(self.path(part, "rows"), dtype=ROW)
        return Rows(rows, np.fromfile(self.path(part, "tok"), dtype=np.int32))

    def chunks(self, part: int, rows_per_chunk: int) -> Iterator[Rows]:
        """The partition in chunks of ``rows_per_chunk`` rows, in order."""
        tok_at = 0
        for start in range(0, int(self.num_rows[part]), rows_per_chunk):
            n = min(rows_per_chunk, int(self.num_rows[part]) - start)
            rows = np.fromfile(
                self.path(part, "rows"), dtype=ROW, count=n, offset=start * ROW.itemsize
            )
            count = int(rows["length"].sum())
            tok = np.fromfile(
                self.path(part, "tok"), dtype=np.int32, count=count, offset=tok_at * 4
            )
            tok_at += count
            yield Rows(rows, tok)

    def remove(self, part: int) -> None:
        for kind in ("rows", "tok"):
            with suppress(FileNotFoundError):
                os.remove(self.path(part, kind))


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """int64: starts[i] .. starts[i] + sizes[i] - 1, concatenated."""
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(int(sizes.sum()), dtype=np.int64) - seg)
