"""Scoring mode (``sampling.labels`` / ``input.labels_column``): the log-probability of each
label continuation after the prompt, nothing generated.

A row's labels (token ids, tokenized as continuations) form a trie. The log-softmax of the
logits after the prompt + a node's label prefix scores that node's child tokens; a label's
log-probability is the sum over its tokens (teacher-forced). Single-token labels ("Yes"/"No",
"A".."D") only need the root: the logits of the prompt's last position, so the job is pure
prefill and keeps the plan's whole prefix saving. Two ways to get the deeper nodes:

- native engine (``row_tries`` + ``RowScores``): ONE request per row, the prompt, run on the
  input's own plan (so a query shared by its documents stays shared). After the prompt, the
  row's sequence is teacher-forced through the trie (``_Trie.steps``, depth-first): each step
  feeds a chain of label tokens as one prefill chunk whose logits are read at every position,
  then the sequence's KV is rewound to the branch point of the next chain (the scheduler
  frees the blocks past it). Each non-root node with children costs one token of forward
  work, labels sharing leading tokens share those tokens;
- vLLM backend (``expand`` + ``LabelCombiner``): every trie node with children becomes one
  request (the prompt + the node's label prefix, one step); vLLM's prefix cache shares the
  prompt between them. A backend runs ``ScoringRequests.prompts`` (max_tokens 1) and hands
  each request's target log-probs to ``LabelCombiner.add``, which emits one
  ``FinishedRequest`` per original row when all of that row's requests are in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from batchjob.backends.base import FinishedRequest
from batchjob.tokenize.prompts import TokenizedPrompts


@dataclass(frozen=True)
class _Trie:
    prefixes: tuple[tuple[int, ...], ...]  # label prefix of each node with children (root ())
    targets: tuple[np.ndarray, ...]  # int32: child tokens of each node
    paths: tuple[tuple[tuple[int, int], ...], ...]  # per label: (node, target index) per token
    # teacher-forced walk after the prompt (root = node 0, read at the prompt's last token):
    # per step (base, path, nodes): rewind the label part of the KV to ``base`` tokens, feed
    # path[base:]; the logits at the token of path[j] score node nodes[j - base]
    steps: tuple[tuple[int, np.ndarray, np.ndarray], ...]


def _trie(label_tokens: tuple[np.ndarray, ...]) -> _Trie:
    node_of: dict[tuple[int, ...], int] = {}
    children: list[list[int]] = []
    paths = []
    for toks in label_tokens:
        path = []
        t = [int(x) for x in toks]
        for k in range(len(t)):
            pre = tuple(t[:k])
            n = node_of.get(pre)
            if n is None:
                n = node_of[pre] = len(children)
                children.append([])
            kids = children[n]
            if t[k] not in kids:
                kids.append(t[k])
            path.append((n, kids.index(t[k])))
        paths.append(tuple(path))
    prefixes = tuple(sorted(node_of, key=node_of.__getitem__))
    return _Trie(
        prefixes,
        tuple(np.asarray(c, dtype=np.int32) for c in children),
        tuple(paths),
        _steps(node_of),
    )


def _steps(node_of: dict[tuple[int, ...], int]) -> tuple[tuple[int, np.ndarray, np.ndarray], ...]:
    """The non-root nodes with children in depth-first preorder, cut into chains: a node
    extends the chain when it is the child of the chain's last node; otherwise a new step
    starts at its parent's depth (an ancestor of the last node in preorder, so its KV is the
    leading part of what the sequence holds)."""
    steps: list[tuple[int, np.ndarray, np.ndarray]] = []
    path: tuple[int, ...] = ()
    base = 0
    nodes: list[int] = []
    for pre in sorted(p for p in node_of if p):  # tuple order: depth-first preorder
        if nodes and len(pre) == len(path) + 1 and pre[:-1] == path:
            nodes.append(node_of[pre])
        else:
            if nodes:
                steps.append((base, np.asarray(path, np.int32), np.asarray(nodes, np.int64)))
            base, nodes = len(pre) - 1, [node_of[pre]]
        path = pre
    if nodes:
        steps.append((base, np.asarray(path, np.int32), np.asarray(nodes, np.int64)))
    return tuple(steps)


def row_tries(prompts: TokenizedPrompts) -> tuple[tuple[_Trie, ...], tuple[tuple[str, ...], ...]]:
    """Every row's label trie and label texts, per input position (equal labels: one trie)."""
    rs = prompts.settings
    if rs is None or rs.labels is None or rs.label_tokens is None:
        raise ValueError("scoring needs per-row labels (prompts.settings.labels)")
    cache: dict[tuple[bytes, ...], _Trie] = {}
    tries, labels = [], []
    for pos in range(len(prompts)):
        i = rs.index(int(prompts.row_ids[pos]))
        toks = rs.label_tokens[i]
        key = tuple(t.tobytes() for t in toks)
        trie = cache.get(key)
        if trie is None:
            trie = cache[key] = _trie(toks)
        tries.append(trie)
        labels.append(rs.labels[i])
    return tuple(tries), tuple(labels)


def _finished_row(
    pos: int, row_id: int, labels: tuple[str, ...], scores: np.ndarray
) -> FinishedRequest:
    """A row's result from its labels' log-probs (float32, aligned with ``labels``)."""
    best = labels[int(np.argmax(scores))]
    return FinishedRequest(
        position=pos,
        row_id=row_id,
        token_ids=np.zeros(0, dtype=np.int32),
        finish_reason="score",
        text=best,
        label_logprobs=scores,
        label=best,
    )


class RowScores:
    """Every row's trie-node target log-probs (one request per row, ``row_tries``) in one
    float32 buffer, written by numpy scatters (no Python per scored position): row ``pos``
    owns ``buf[row_base[pos] : row_base[pos] + size]``, its trie's targets node by node.
    ``finish(pos)`` (the scheduler finished the row: all its nodes were read) sums each
    label's path and emits the row. A node read twice (a row preempted and recomputed
    mid-step) keeps its latest value."""

    def __init__(
        self,
        tries: tuple[_Trie, ...],
        labels: tuple[tuple[str, ...], ...],
        row_ids: np.ndarray,
        on_finish: Callable[[FinishedRequest], None],
    ) -> None:
        self.tries = tries
        self.labels = labels
        self.row_ids = row_ids
        self.on_finish = on_finish
        n = len(tries)
        index: dict[int, int] = {}
        self._tid = np.fromiter(
            (index.setdefault(id(t), len(index)) for t in tries), dtype=np.int64, count=n
        )
        distinct = list({id(t): t for t in tries}.values())  # in index order
        width = max((len(t.targets) for t in distinct), default=0) + 1
        self._node_off = np.zeros((len(distinct), width), dtype=np.int64)  # [T, nodes + 1]
        self._paths: list[list[np.ndarray]] = []  # per trie, per label: its flat target indices
        flats = []
        for i, t in enumerate(distinct):
            off = np.zeros(len(t.targets) + 1, dtype=np.int64)
            np.cumsum([len(x) for x in t.targets], out=off[1:])
            self._node_off[i, : len(off)] = off
            flats.append(np.concatenate(t.targets).astype(np.int64))
            self._paths.append([np.asarray([off[nd] + k for nd, k in p]) for p in t.paths])
        sizes = np.fromiter(map(len, flats), dtype=np.int64, count=len(flats))
        self._tok_base = np.cumsum(sizes) - sizes  # [T]: each trie's targets in _tok
        self._tok = np.concatenate(flats) if flats else np.zeros(0, np.int64)
        self._size = sizes[self._tid]  # [N]
        self._row_base = np.cumsum(self._size) - self._size
        self.buf = np.zeros(int(self._size.sum()), dtype=np.float32)

    def gather_index(
        self, seqs: np.ndarray, nodes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For scored positions (row ``seqs[j]``, trie node ``nodes[j]``): per target, the
        position j, the target token id and its slot in ``buf`` (all int64, ragged flat)."""
        t = self._tid[seqs]
        a = self._node_off[t, nodes]
        k = self._node_off[t, nodes + 1] - a
        rep = np.repeat(np.arange(len(seqs)), k)
        within = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
        tok = self._tok[np.repeat(self._tok_base[t] + a, k) + within]
        dest = np.repeat(self._row_base[seqs] + a, k) + within
        return rep, tok, dest

    def finish(self, pos: int) -> None:
        """Row ``pos`` is complete: emit its labels' log-probs (each the sum of its path)."""
        base = int(self._row_base[pos])
        vals = self.buf[base : base + int(self._size[pos])].astype(np.float64)
        paths = self._paths[int(self._tid[pos])]
        scores = np.asarray([vals[ix].sum() for ix in paths], dtype=np.float32)
        self.on_finish(_finished_row(pos, int(self.row_ids[pos]), self.labels[pos], scores))


@dataclass(frozen=True)
class ScoringRequests:
    """The requests that score every row's labels."""

    prompts: TokenizedPrompts  # E requests, max_tokens 1, no per-row settings
    targets: tuple[np.ndarray, ...]  # [E] int32: tokens scored after each request
    origin: np.ndarray  # int64 [E]: position of each request's row in the input prompts
    node: np.ndarray  # int64 [E]: trie node of each request within its row
    tries: tuple[_Trie, ...]  # [N] per input position (shared objects for equal labels)
    labels: tuple[tuple[str, ...], ...]  # [N]

    @property
    def same_rows(self) -> bool:
        """One request per row, in the input order: the input's plan applies as is."""
        return len(self.origin) == len(self.tries)


def expand(prompts: TokenizedPrompts) -> ScoringRequests:
    """The scoring requests of every row (``prompts.settings`` holds its labels)."""
    n = len(prompts)
    tries, labels = row_tries(prompts)
    counts = np.fromiter((len(t.prefixes) for t in tries), dtype=np.int64, count=n)
    origin = np.repeat(np.arange(n, dtype=np.int64), counts)
    node = np.arange(len(origin), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    targets = tuple(tries[o].targets[k] for o, k in zip(origin, node, strict=True))
    ones = np.ones(len(origin), dtype=np.int32)
    if len(origin) == n:  # single-token labels: the prompts themselves
        req = TokenizedPrompts(prompts.row_ids, prompts.tokens, prompts.offsets, ones)
    else:
        seqs = [
            np.concatenate([prompts.row(int(o)), np.asarray(tries[o].prefixes[k], np.int32)])
            for o, k in zip(origin, node, strict=True)
        ]
        req = TokenizedPrompts.from_lists(seqs, row_ids=prompts.row_ids[origin], max_tokens=ones)
    return ScoringRequests(req, targets, origin, node, tries, labels)


class LabelCombiner:
    """Collects the requests' target log-probs; emits each row once all its requests are in."""

    def __init__(
        self,
        req: ScoringRequests,
        row_ids: np.ndarray,
        on_finish: Callable[[FinishedRequest], None],
    ) -> None:
        self.req = req
        self.row_ids = row_ids
        self.on_finish = on_finish
        self._left = np.bincount(req.origin, minlength=len(req.tries)).astype(np.int64)
        self._got: dict[int, dict[int, np.ndarray]] = {}

    def add(self, request: int, target_logprobs: np.ndarray) -> None:
        """``request``: index in ``req.prompts``; its targets' log-probs (float32)."""
        pos = int(self.req.origin[request])
        got = self._got.setdefault(pos, {})
        got[int(self.req.node[request])] = target_logprobs
        self._left[pos] -= 1
        if self._left[pos]:
            return
        del self._got[pos]
        paths = self.req.tries[pos].paths
        scores = np.asarray(
            [sum(float(got[nd][t]) for nd, t in path) for path in paths], dtype=np.float32
        )
        self.on_finish(_finished_row(pos, int(self.row_ids[pos]), self.req.labels[pos], scores))

    def on_request(self, o: FinishedRequest) -> None:
        """A backend's finished scoring request (``target_logprobs`` set)."""
        if o.target_logprobs is None:
            raise RuntimeError(f"scoring request {o.position} finished without target logprobs")
        self.add(o.position, o.target_logprobs)
