"""Synthetic workloads of the BatchLLM paper (and one without sharing), as Arrow tables.

Every workload is built from groups: a shared prefix and, per member, a distinct suffix.
Rows are shuffled (real data does not arrive grouped). Columns: ``prompt`` (list<int32>
token ids, or text), ``max_tokens`` (int32), ``request_id`` (position before shuffling) and
ids of the shared parts (``group_id`` / ``doc_id`` / ``query_id``).

Workloads (lengths in tokens, before ``len_scale``):

- ``micro-<prefix>-<distinct>-s<share>``: 1024 requests, groups of exactly ``share``,
  exact lengths. The paper's six: prefix/distinct 2000/200, 1000/1000, 200/2000 at s4, s16.
- ``case1`` (snippet generation): ~3000 requests; a 30-token instruction shared by all rows,
  then a ~1070-token document per group (prefix ~1100), then a ~400-token query per row;
  group sizes 1 + Poisson(6) (mean 7); max_tokens 100.
- ``case2`` (ranking): ~1000 requests; instruction + a ~740-token query per group (prefix
  ~770), then a ~978-token document per row; group sizes 1 + Poisson(10.36) (mean 11.36);
  max_tokens 50.
- ``nosharing`` (continuous-batching article): 1000 requests of 512 random tokens; output
  lengths exponential with mean 128, capped at 1536, in ``max_tokens`` (run with ignore_eos).
- ``natural-qa`` (questions about documents, multi-level): ~1000 requests; a 40-token
  instruction shared by all rows, then a ~400-token document shared by ~8 rows (1 +
  Poisson(7)), then a short question of 15-29 tokens per row; max_tokens 32.
- ``long-doc`` (long-document QA): ~1000 requests; a 20-token instruction shared by all rows,
  then a document of 1,500-3,500 tokens (uniform) asked 5-100 questions (uniform), then a
  question of 10-30 tokens per row; max_tokens 32. Where the method gains most: a long
  prefix, many members, short outputs.

``len_scale`` multiplies prompt and output lengths, ``scale`` the request count, so a
workload can shrink to a 2-core CPU while keeping its shape.

Text form: tokens are words of a fixed pseudo-word list joined by single spaces, so a shared
prefix stays a shared token prefix under word-splitting tokenizers (ByteLevel BPE, Metaspace);
a word may take more than one token with a tokenizer not trained on the list.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

MICRO = [
    f"micro-{p}-{d}-s{s}" for p, d in ((2000, 200), (1000, 1000), (200, 2000)) for s in (4, 16)
]
WORKLOADS = [*MICRO, "case1", "case2", "nosharing", "natural-qa", "long-doc"]
DEFAULT_VOCAB_LO = 16  # ids below this are left to special tokens


def _make_words() -> tuple[str, ...]:
    """2048 pronounceable 4-letter words, fixed across runs and platforms."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    syll = [c + v for c in cons for v in vows]
    words = [a + b for a in syll for b in syll]
    order = np.random.default_rng(1234).permutation(len(words))[:2048]
    return tuple(words[i] for i in sorted(order))


WORDS = _make_words()


@dataclass(frozen=True)
class _Rows:
    """A workload before shuffling and encoding: symbol sequences plus columns."""

    segments: list[list[np.ndarray]]  # per row: symbol arrays to concatenate
    max_tokens: np.ndarray  # int32 [N]
    columns: dict[str, np.ndarray]  # extra int64 columns [N]


class _Gen:
    """Symbol sampler: ids in [lo, hi); heads of sibling branches differ where possible."""

    def __init__(self, rng: np.random.Generator, lo: int, hi: int, len_scale: float):
        self.rng, self.lo, self.hi, self.len_scale = rng, lo, hi, len_scale

    def length(self, mean: float, jitter: float = 0.0) -> int:
        f = self.rng.uniform(1 - jitter, 1 + jitter) if jitter else 1.0
        return max(1, round(mean * self.len_scale * f))

    def heads(self, k: int) -> np.ndarray:
        """k first symbols, all different when the range allows it."""
        span = self.hi - self.lo
        return self.lo + self.rng.choice(span, size=k, replace=k > span)

    def seqs(self, lengths: list[int]) -> list[np.ndarray]:
        """Random sequences whose first symbols differ from each other."""
        heads = self.heads(len(lengths))
        out = []
        for h, n in zip(heads, lengths, strict=True):
            s = self.rng.integers(self.lo, self.hi, size=n, dtype=np.int64)
            s[0] = h
            out.append(s)
        return out


def _group_sizes(rng: np.random.Generator, n: int, mean: float, exact: bool) -> list[int]:
    """Group sizes summing to n: all ``mean`` if exact, else 1 + Poisson(mean - 1)."""
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(int(mean) if exact else 1 + int(rng.poisson(mean - 1)))
    sizes[-1] -= sum(sizes) - n
    return sizes


def _grouped(
    g: _Gen,
    n: int,
    share: float,
    exact: bool,
    instr_len: float,
    prefix_len: float,
    distinct_len: float,
    jitter: float,
    max_tokens: int,
    names: tuple[str, str],
) -> _Rows:
    """Rows = [instruction shared by all] + group prefix + distinct suffix."""
    sizes = _group_sizes(g.rng, n, share, exact)
    instr = g.seqs([g.length(instr_len)])[0] if instr_len else None
    prefixes = g.seqs([g.length(prefix_len, jitter) for _ in sizes])
    segments: list[list] = []
    group_col: list[int] = []
    member_col: list[int] = []
    for gi, (size, prefix) in enumerate(zip(sizes, prefixes, strict=True)):
        head = [instr, prefix] if instr is not None else [prefix]
        for suffix in g.seqs([g.length(distinct_len, jitter) for _ in range(size)]):
            segments.append([*head, suffix])
            group_col.append(gi)
            member_col.append(len(member_col))  # distinct parts are unique across the dataset
    mt = np.full(len(segments), max(1, round(max_tokens * g.len_scale)), dtype=np.int32)
    return _Rows(
        segments,
        mt,
        {names[0]: np.asarray(group_col, np.int64), names[1]: np.asarray(member_col, np.int64)},
    )


def _nosharing(g: _Gen, n: int, max_out: int, out_mean: float) -> _Rows:
    seqs = g.seqs([g.length(512) for _ in range(n)])
    cap = max(1, round(max_out * g.len_scale))
    out = np.empty(0)
    while len(out) < n:  # the article keeps only samples <= the cap
        draw = g.rng.exponential(out_mean * g.len_scale, size=2 * n)
        out = np.concatenate([out, draw[draw <= cap]])
    mt = np.maximum(1, np.ceil(out[:n])).astype(np.int32)
    return _Rows([[s] for s in seqs], mt, {})


def _long_docs(g: _Gen, n: int, max_tokens: int) -> _Rows:
    """Rows = [instruction] + document (1,500-3,500 tokens) + question (10-30 tokens); each
    document asked 5-100 questions."""
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(int(g.rng.integers(5, 101)))
    sizes[-1] -= sum(sizes) - n
    sizes = [s for s in sizes if s > 0]
    instr = g.seqs([g.length(20)])[0]
    docs = g.seqs([g.length(float(g.rng.integers(1500, 3501))) for _ in sizes])
    segments: list[list] = []
    doc_col: list[int] = []
    for di, (size, doc) in enumerate(zip(sizes, docs, strict=True)):
        for question in g.seqs([g.length(float(g.rng.integers(10, 31))) for _ in range(size)]):
            segments.append([instr, doc, question])
            doc_col.append(di)
    mt = np.full(len(segments), max(1, round(max_tokens * g.len_scale)), dtype=np.int32)
    ids = np.arange(len(segments), dtype=np.int64)
    return _Rows(segments, mt, {"doc_id": np.asarray(doc_col, np.int64), "question_id": ids})


def _build(name: str, g: _Gen, scale: float) -> _Rows:
    def count(base: int) -> int:
        return max(1, round(base * scale))

    if m := re.fullmatch(r"micro-(\d+)-(\d+)-s(\d+)", name):
        p, d, s = (int(x) for x in m.groups())
        return _grouped(g, count(1024), s, True, 0, p, d, 0.0, 100, ("group_id", "distinct_id"))
    if name == "case1":
        return _grouped(g, count(3000), 7, False, 30, 1070, 400, 0.15, 100, ("doc_id", "query_id"))
    if name == "case2":
        return _grouped(
            g, count(1000), 11.36, False, 30, 740, 978, 0.15, 50, ("query_id", "doc_id")
        )
    if name == "nosharing":
        return _nosharing(g, count(1000), 1536, 128.0)
    if name == "natural-qa":
        return _grouped(g, count(1000), 8, False, 40, 400, 22, 0.32, 32, ("doc_id", "question_id"))
    if name == "long-doc":
        return _long_docs(g, count(1000), 32)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def make_workload(
    name: str,
    scale: float = 1.0,
    len_scale: float = 1.0,
    seed: int = 0,
    form: str = "ids",
    vocab_size: int = 32000,
    *,
    vocab_lo: int = DEFAULT_VOCAB_LO,
    max_tokens: int | None = None,
) -> pa.Table:
    """Build workload ``name`` as a table (rows shuffled; same arguments, same table).

    ``form="ids"``: ``prompt`` is list<int32> with ids in [vocab_lo, vocab_size);
    ``form="text"``: ``prompt`` is a string of words from ``WORDS``.
    ``max_tokens`` replaces the workload's per-row output length with a constant.
    """
    if form not in ("ids", "text"):
        raise ValueError(f"form must be 'ids' or 'text', got {form!r}")
    if scale <= 0 or len_scale <= 0:
        raise ValueError("scale and len_scale must be > 0")
    lo, hi = (vocab_lo, vocab_size) if form == "ids" else (0, len(WORDS))
    if hi - lo < 2:
        raise ValueError(f"vocab range [{lo}, {hi}) is too small")
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    rows = _build(name, _Gen(rng, lo, hi, len_scale), scale)

    order = rng.permutation(len(rows.segments))
    seqs = [np.concatenate(rows.segments[i]) for i in order]
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.concatenate(seqs)
    if form == "ids":
        offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        prompt = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(np.int32)))
    else:
        words = np.asarray(WORDS, dtype=object)[flat]
        ends = np.cumsum(lengths)
        prompt = pa.array([" ".join(words[e - n : e]) for e, n in zip(ends, lengths, strict=True)])
    mt = rows.max_tokens[order] if max_tokens is None else np.full(len(order), max_tokens)
    cols: dict[str, pa.Array] = {"request_id": pa.array(order.astype(np.int64))}
    cols.update({k: pa.array(v[order]) for k, v in rows.columns.items()})
    cols["prompt"] = prompt
    cols["max_tokens"] = pa.array(mt.astype(np.int32))
    return pa.table(cols)


# ranking/scoring example (jobs/ranking_labels.toml): one instruction, (query, document) rows
RANKING_INSTRUCTION = " ".join(WORDS[:16])  # shared by every row: "Is the document relevant to ..."


def ranking_table(rows: int, seed: int = 0, query_words: int = 16, doc_words: int = 40) -> pa.Table:
    """``rows`` (query, document) prompts, 8-16 documents per query, shuffled."""
    rng = np.random.default_rng(seed)
    words = np.asarray(WORDS[16:])
    prompts: list[str] = []
    qids: list[int] = []
    q = 0
    while len(prompts) < rows:
        query = " ".join(rng.choice(words, query_words))
        for _ in range(min(int(rng.integers(8, 17)), rows - len(prompts))):
            doc = " ".join(rng.choice(words, doc_words))
            prompts.append(f"{RANKING_INSTRUCTION} query {query} document {doc} relevant:")
            qids.append(q)
        q += 1
    order = rng.permutation(len(prompts))
    return pa.table(
        {
            "prompt": pa.array([prompts[i] for i in order], pa.string()),
            "query_id": pa.array(np.asarray(qids, dtype=np.int64)[order]),
        }
    )
