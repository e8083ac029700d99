"""Scoring mode (``sampling.labels`` / ``input.labels_column``): the log-probability of each
label continuation after the prompt, nothing generated.

A row's labels (token ids, tokenized as continuations) form a trie. Every trie node that has
children becomes one request: the prompt followed by the node's label prefix, run for one
step; the log-softmax of its last position scores the node's child tokens. A label's
log-probability is the sum over its tokens (teacher-forced). So:

- single-token labels ("Yes"/"No", "A".."D"): one request per row, the prompt itself; all
  labels are read from the same last-position logits. No extra forward work at all: the job
  is pure prefill and keeps the plan's whole prefix saving;
- a label of k tokens adds at most k - 1 requests (labels sharing leading tokens share those
  nodes), each the prompt + up to k - 1 label tokens. Those requests share the prompt as a
  prefix, so the planner groups them and only their label tokens are computed again.

Backend-neutral: a backend runs ``ScoringRequests.prompts`` (max_tokens 1) and hands each
request's target log-probs to ``LabelCombiner.add``, which emits one ``FinishedRequest`` per
original row when all of that row's requests are in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from batchjob.backends.base import FinishedRequest
from batchjob.prompts import TokenizedPrompts


@dataclass(frozen=True)
class _Trie:
    prefixes: tuple[tuple[int, ...], ...]  # label prefix of each node with children (root ())
    targets: tuple[np.ndarray, ...]  # int32: child tokens of each node
    paths: tuple[tuple[tuple[int, int], ...], ...]  # per label: (node, target index) per token


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
    return _Trie(prefixes, tuple(np.asarray(c, dtype=np.int32) for c in children), tuple(paths))


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
    rs = prompts.settings
    if rs is None or rs.labels is None or rs.label_tokens is None:
        raise ValueError("scoring needs per-row labels (prompts.settings.labels)")
    n = len(prompts)
    cache: dict[tuple[bytes, ...], _Trie] = {}
    tries, labels = [], []
    for pos in range(n):
        i = rs.index(int(prompts.row_ids[pos]))
        toks = rs.label_tokens[i]
        key = tuple(t.tobytes() for t in toks)
        trie = cache.get(key)
        if trie is None:
            trie = cache[key] = _trie(toks)
        tries.append(trie)
        labels.append(rs.labels[i])
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
    return ScoringRequests(req, targets, origin, node, tuple(tries), tuple(labels))


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
        trie = self.req.tries[pos]
        scores = np.asarray(
            [sum(float(got[nd][t]) for nd, t in path) for path in trie.paths], dtype=np.float32
        )
        labels = self.req.labels[pos]
        best = labels[int(np.argmax(scores))]
        self.on_finish(
            FinishedRequest(
                position=pos,
                row_id=int(self.row_ids[pos]),
                token_ids=np.zeros(0, dtype=np.int32),
                finish_reason="score",
                text=best,
                label_logprobs=scores,
                label=best,
            )
        )

    def on_request(self, o: FinishedRequest) -> None:
        """A backend's finished scoring request (``target_logprobs`` set)."""
        if o.target_logprobs is None:
            raise RuntimeError(f"scoring request {o.position} finished without target logprobs")
        self.add(o.position, o.target_logprobs)
