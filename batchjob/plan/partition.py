"""Partitions of a dataset by its rows' leading tokens, spilled to disk.

Two rows whose first ``d`` tokens differ (or one of which has fewer than ``d`` tokens) share
at most ``d - 1`` tokens in the planning tree (the prompts without their last token), so
rows split by a key of their first ``d`` tokens can be planned apart, each partition on its
own; the split can lose only prefixes shorter than ``d`` tokens shared across partitions.

The key is a hash of (the first ``min(d, len)`` tokens, that count): a linear hash with one
random 64-bit weight per position, summed with one cumulative sum over the tokens (every
depth at once, O(tokens)), then mixed (splitmix64) and taken modulo the partition count.
Rows of equal keys always land together; a collision only plans two keys together.

Rows of a LoRA adapter (``Rows.adapter``) are keyed by (adapter, leading tokens): rows of
two adapters share nothing in the plan (``plan.build`` plans each adapter apart), so they
never need the same partition.

``PartitionSpill`` appends rows batch by batch to two raw files per partition under a
folder: ``pNNNNN.rows`` (a record per row: position, row_id, length, max_tokens) and
``pNNNNN.tok`` (int32 tokens, row after row); rows that carry per-row settings or an adapter
(``Rows.settings``, ``Rows.adapter``) add ``pNNNNN.set``, the chunk's settings and adapter
indices pickled, one length-prefixed record per chunk appended. ``position`` is the
request position the in-memory planner gives the row's first request: its index among the
dataset's valid rows in input order, or with samples (``sampling.n``) the samples of the
valid rows before it; sample ``k`` of the row is at ``position + k``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.samples import expand_samples, sample_counts

if TYPE_CHECKING:
    from batchjob.inputs.row_settings import RowSettings

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


def with_adapter(keys: np.ndarray, adapter: np.ndarray | None) -> np.ndarray:
    """Keys (uint64 [..., N]) of rows of a LoRA adapter each (int [N]; None: all the base
    model's): (adapter, tokens) keys, unchanged for the base model (-1)."""
    if adapter is None:
        return keys
    a = np.asarray(adapter).astype(np.int64)
    with np.errstate(over="ignore"):
        salt = (a + 1).astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93)
        return np.where(a < 0, keys, _mix(keys ^ salt))


def partition_of(keys: np.ndarray, num_parts: int) -> np.ndarray:
    """int64: the partition of each key."""
    return (keys % np.uint64(num_parts)).astype(np.int64)


@dataclass(frozen=True)
class Rows:
    """Rows of one partition (or a chunk of one): a record per row and their tokens, and
    the rows' per-row settings and LoRA adapters where the job has them."""

    rows: np.ndarray  # ROW [n]
    tokens: np.ndarray  # int32 [sum of lengths]
    settings: RowSettings | None = None  # keyed by row_id: exactly these rows'
    adapter: np.ndarray | None = None  # int32 [n]: index in model.adapters, -1: base model

    @property
    def offsets(self) -> np.ndarray:
        off = np.zeros(len(self.rows) + 1, dtype=np.int64)
        np.cumsum(self.rows["length"], out=off[1:])
        return off

    @property
    def has_extras(self) -> bool:
        return self.settings is not None or self.adapter is not None

    def keys(self, depths: tuple[int, ...], offsets: np.ndarray | None = None) -> np.ndarray:
        """uint64 [len(depths), n]: each row's partition key at each depth (``prefix_keys``,
        by adapter too)."""
        off = self.offsets if offsets is None else offsets
        return with_adapter(prefix_keys(self.tokens, off, depths), self.adapter)

    def prompts(self) -> TokenizedPrompts:
        """The rows as prompts (positions in the partition; ``rows["position"]`` maps back)."""
        return TokenizedPrompts(
            row_ids=self.rows["row_id"].copy(),
            tokens=self.tokens,
            offsets=self.offsets,
            max_tokens=self.rows["max_tokens"].copy(),
            settings=self.settings,
            adapter=None if self.adapter is None else self.adapter.copy(),
        )

    def requests(
        self, samples: tuple[int, bool] = (1, False)
    ) -> tuple[TokenizedPrompts, np.ndarray]:
        """The rows' requests, every row's samples (``samples``: ``sampling.n``, whether rows
        set their own; ``expand_samples``), and each request's position in the dataset's
        request order (int64)."""
        prompts = self.prompts()
        if samples == (1, False):
            return prompts, self.rows["position"].copy()
        counts = sample_counts(prompts, samples[0])
        out = expand_samples(prompts, *samples)
        return out, np.repeat(self.rows["position"], counts) + out.samples

    def take(self, which: np.ndarray) -> Rows:
        """Rows ``which`` (int positions, ascending)."""
        from batchjob.inputs.row_settings import settings_of_rows

        rows = self.rows[which]
        tok = self.tokens[_ranges(self.offsets[:-1][which], self.rows["length"][which])]
        settings = (
            None if self.settings is None else settings_of_rows(self.settings, rows["row_id"])
        )
        adapter = None if self.adapter is None else self.adapter[which]
        return Rows(rows, tok.astype(np.int32, copy=False), settings, adapter)


def _concat_rows(chunks: list[Rows]) -> Rows:
    from batchjob.inputs.row_settings import concat_settings

    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    settings = (
        None
        if first.settings is None
        else concat_settings([c.settings for c in chunks if c.settings is not None])
    )
    adapter = (
        None
        if first.adapter is None
        else np.concatenate([c.adapter for c in chunks if c.adapter is not None])
    )
    return Rows(
        np.concatenate([c.rows for c in chunks]),
        np.concatenate([c.tokens for c in chunks]),
        settings,
        adapter,
    )


def _extras_records(path: Path) -> Iterator[tuple[RowSettings | None, np.ndarray | None]]:
    """The (settings, adapter) records of a ``.set`` file, in order."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        while head := f.read(8):
            yield pickle.loads(f.read(int.from_bytes(head, "little")))


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
        key = chunk.keys((self.depth,), offsets)[0]
        self.add_to(chunk, offsets, partition_of(key, self.num_parts))

    def add_to(self, chunk: Rows, offsets: np.ndarray, part: np.ndarray) -> None:
        """Append ``chunk``'s rows to the partitions ``part`` (int64 [n]) names."""
        from batchjob.inputs.row_settings import take_settings

        order = np.argsort(part, kind="stable")  # input order kept within a partition
        bounds = np.searchsorted(part[order], np.arange(self.num_parts + 1))
        lengths = chunk.rows["length"]
        if chunk.settings is not None:  # the settings' index of each row
            at = np.searchsorted(chunk.settings.row_ids, chunk.rows["row_id"])
        for p in np.flatnonzero(np.diff(bounds)):
            idx = order[bounds[p] : bounds[p + 1]]
            tok = chunk.tokens[_ranges(offsets[:-1][idx], lengths[idx])]
            with open(self.path(int(p), "rows"), "ab") as f:
                chunk.rows[idx].tofile(f)
            with open(self.path(int(p), "tok"), "ab") as f:
                tok.astype(np.int32, copy=False).tofile(f)
            if chunk.has_extras:
                settings = (
                    None if chunk.settings is None else take_settings(chunk.settings, at[idx])
                )
                adapter = None if chunk.adapter is None else chunk.adapter[idx]
                blob = pickle.dumps((settings, adapter), protocol=pickle.HIGHEST_PROTOCOL)
                with open(self.path(int(p), "set"), "ab") as f:
                    f.write(len(blob).to_bytes(8, "little"))
                    f.write(blob)
            self.num_rows[p] += len(idx)
            self.num_tokens[p] += len(tok)

    def read(self, part: int) -> Rows:
        """The whole partition."""
        if not self.num_rows[part]:
            return Rows(np.zeros(0, dtype=ROW), np.zeros(0, dtype=np.int32))
        rows = np.fromfile(self.path(part, "rows"), dtype=ROW)
        out = Rows(rows, np.fromfile(self.path(part, "tok"), dtype=np.int32))
        return self._with_extras(out, list(_extras_records(self.path(part, "set"))))

    @staticmethod
    def _with_extras(rows: Rows, records: list) -> Rows:
        """``rows`` with the settings and adapters of ``records`` (exactly its rows)."""
        from batchjob.inputs.row_settings import concat_settings

        if not records:
            return rows
        settings = [s for s, _ in records if s is not None]
        adapters = [a for _, a in records if a is not None]
        return Rows(
            rows.rows,
            rows.tokens,
            concat_settings(settings) if settings else None,
            np.concatenate(adapters) if adapters else None,
        )

    def chunks(self, part: int, rows_per_chunk: int) -> Iterator[Rows]:
        """The partition in chunks of ``rows_per_chunk`` rows, in order."""
        tok_at = 0
        extras = _extras_records(self.path(part, "set"))
        carry: Rows | None = None  # the extras read past the last chunk's rows
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
            chunk = Rows(rows, tok)
            if self.path(part, "set").exists():
                chunk, carry = self._extras_for(chunk, extras, carry)
            yield chunk

    def _extras_for(
        self, chunk: Rows, extras: Iterator, carry: Rows | None
    ) -> tuple[Rows, Rows | None]:
        """``chunk`` with its extras, read on from ``extras`` (records) past ``carry``."""
        n = len(chunk.rows)
        got = [] if carry is None else [carry]
        have = 0 if carry is None else len(carry.rows)
        while have < n:
            settings, adapter = next(extras)
            m = len(settings.row_ids) if settings is not None else len(adapter)
            got.append(Rows(np.zeros(m, dtype=ROW), np.zeros(0, np.int32), settings, adapter))
            have += m
        joined = _concat_rows(got)
        head = PartitionSpill._slice_extras(joined, 0, n)
        rest = PartitionSpill._slice_extras(joined, n, have) if have > n else None
        return Rows(chunk.rows, chunk.tokens, head.settings, head.adapter), rest

    @staticmethod
    def _slice_extras(r: Rows, lo: int, hi: int) -> Rows:
        from batchjob.inputs.row_settings import take_settings

        which = np.arange(lo, hi, dtype=np.int64)
        return Rows(
            r.rows[lo:hi],
            r.tokens[:0],
            None if r.settings is None else take_settings(r.settings, which),
            None if r.adapter is None else r.adapter[lo:hi],
        )

    def remove(self, part: int) -> None:
        for kind in ("rows", "tok", "set"):
            with suppress(FileNotFoundError):
                os.remove(self.path(part, kind))


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """int64: starts[i] .. starts[i] + sizes[i] - 1, concatenated."""
    seg = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + (np.arange(int(sizes.sum()), dtype=np.int64) - seg)
