"""Prompt log-probs on the native engine (``sampling.prompt_logprobs = k``).

Prompt token ``i >= 1`` gets the float32 log-softmax of the raw logits at position ``i - 1``
(its own log-prob and the top k), as vLLM's ``prompt_logprobs``; token 0 has none. The logits
rows are read in the prefill chunks that compute those positions anyway:

- a group prefix's chunk (``seq_id < 0``): its positions ``0 .. P-2`` predict prefix tokens,
  stored once per group and copied to every member when it finishes; position ``P - 1``
  predicts each member's first distinct token (one log-softmax row, each member's token
  gathered from it);
- a member's distinct chunk: positions ``P .. L-2`` (the last prompt position is the
  sampling row, read as always). The samples of a row (``sampling.n``) share one buffer:
  all but the first copy the first's KV instead of computing those positions.

So a shared prefix's log-probs cost one logits row per prefix position, not one per member
(``rows``: the rows read, checked by the tests). A position computed again after a
preemption is read again (same values). Decode and scoring chunks are not read.
"""

from __future__ import annotations

import numpy as np
import torch

from batchjob.backends.base import TokenLogprobs
from batchjob.backends.native.sampling import token_logprobs
from batchjob.backends.native.scheduler.base import request_prefix_len
from batchjob.backends.native.scheduler.output import ScheduledChunk
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts


class _Buffer:
    """Log-probs of prompt tokens 0 .. n-1 (token 0 stays NaN)."""

    __slots__ = ("ids", "lp", "top")

    def __init__(self, n: int, k: int) -> None:
        self.lp = np.full(n, np.nan, dtype=np.float32)
        self.ids = np.zeros((n, k), dtype=np.int32)
        self.top = np.zeros((n, k), dtype=np.float32)

    @staticmethod
    def copy(b: _Buffer) -> _Buffer:
        out = _Buffer(0, 0)
        out.lp, out.ids, out.top = b.lp.copy(), b.ids.copy(), b.top.copy()
        return out


class PromptLogprobs:
    """Collects every request's prompt log-probs over a run (see the module doc)."""

    def __init__(self, prompts: TokenizedPrompts, plan: Plan | None, k: int) -> None:
        n = len(prompts)
        self.prompts, self.k = prompts, k
        self.lengths = prompts.lengths
        self.prefix_of = request_prefix_len(plan, n)  # the group prefix each request follows
        if plan is None:  # no plan: every request a group of its own, without a prefix
            self.group_of = np.arange(n, dtype=np.int64)
            self._left = np.ones(n, dtype=np.int64)
            self._members = np.arange(n, dtype=np.int64)
            self._offsets = np.arange(n + 1, dtype=np.int64)
        else:
            sizes = np.diff(plan.group_offsets)
            self.group_of = np.full(n, -1, dtype=np.int64)
            self.group_of[plan.members] = np.repeat(np.arange(plan.num_groups), sizes)
            self._left = sizes.copy()  # members of each group not finished yet
            self._members, self._offsets = plan.members, plan.group_offsets
        self._own: dict[int, _Buffer] = {}  # by row_id: a row's samples share one prompt
        rows, counts = np.unique(prompts.row_ids, return_counts=True)
        self._row_left = dict(zip(rows.tolist(), counts.tolist(), strict=True))
        self._prefix: dict[int, _Buffer] = {}
        self.rows = 0  # logits rows read for prompt log-probs

    def select(self, chunks: tuple[ScheduledChunk, ...]) -> np.ndarray:
        """int64: the flat-batch token rows (chunks in batch order) whose logits this batch
        must read besides the sampling rows; remembered for ``take``."""
        cu_q = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c.token_ids) for c in chunks], out=cu_q[1:])
        rows: list[np.ndarray] = []
        where: list[tuple[int, int, int]] = []  # (seq_id, first absolute position, count)
        for i, c in enumerate(chunks):
            if c.is_decode or c.score_nodes is not None:
                continue
            seq, n = c.seq_id, len(c.token_ids)
            first = c.position_start  # the chunk's first absolute position
            last = first + n - 1  # a group prefix: every position predicts a prompt token
            if seq >= 0:  # a request: up to its last prompt position but one
                last = min(last, int(self.lengths[seq]) - 2)
            if last < first:
                continue
            rows.append(int(cu_q[i]) + np.arange(last - first + 1))
            where.append((seq, first, last - first + 1))
        self._where = where
        if not rows:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(rows).astype(np.int64)

    def take(self, logits: torch.Tensor) -> None:
        """Store the log-probs of the rows ``select`` chose (``logits``: their raw logits, in
        that order)."""
        if not self._where:
            return
        self.rows += logits.shape[0]
        p, t = self.prompts, self.prompts.tokens
        at = 0
        targets = np.zeros(logits.shape[0], dtype=np.int64)
        for seq, first, n in self._where:  # the token each row predicts (boundary: any)
            src = seq if seq >= 0 else int(self._group_members(-seq - 1)[0])  # a prefix: a member's
            start = p.offsets[src] + first + 1
            targets[at : at + n] = t[start : start + n]
            at += n
        chosen, ids, vals = token_logprobs(logits, torch.from_numpy(targets), self.k)
        c, i, v = chosen.cpu().numpy(), ids.cpu().numpy(), vals.float().cpu().numpy()
        at = 0
        for seq, first, n in self._where:
            sl = slice(at, at + n)
            if seq >= 0:
                buf = self._own_buffer(seq)
                buf.lp[first + 1 : first + 1 + n] = c[sl]
                buf.ids[first + 1 : first + 1 + n], buf.top[first + 1 : first + 1 + n] = (
                    i[sl],
                    v[sl],
                )
            else:
                self._prefix_rows(-seq - 1, first, n, c[sl], i[sl], v[sl], logits[sl])
            at += n

    def _prefix_rows(self, g: int, first: int, n: int, c, i, v, logits: torch.Tensor) -> None:
        size = int(self.prefix_of[self._group_members(g)[0]])
        buf = self._prefix.get(g)
        if buf is None:
            buf = self._prefix[g] = _Buffer(size, self.k)
        inner = min(n, size - 1 - first)  # rows predicting prefix tokens
        if inner > 0:
            buf.lp[first + 1 : first + 1 + inner] = c[:inner]
            buf.ids[first + 1 : first + 1 + inner] = i[:inner]
            buf.top[first + 1 : first + 1 + inner] = v[:inner]
        if first + n == size:  # the last prefix position: each member's first own token
            members = self._group_members(g)
            tokens = self.prompts.tokens[self.prompts.offsets[members] + size]
            row = torch.log_softmax(logits[n - 1].float(), dim=-1)
            own = row[torch.from_numpy(tokens.astype(np.int64))].cpu().numpy()
            for m, lp in zip(members.tolist(), own.tolist(), strict=True):
                b = self._own_buffer(m)
                b.lp[size], b.ids[size], b.top[size] = lp, i[n - 1], v[n - 1]

    def _group_members(self, g: int) -> np.ndarray:
        return self._members[self._offsets[g] : self._offsets[g + 1]]

    def _own_buffer(self, seq: int) -> _Buffer:
        row = int(self.prompts.row_ids[seq])
        buf = self._own.get(row)
        if buf is None:
            buf = self._own[row] = _Buffer(int(self.lengths[seq]), self.k)
        return buf

    def finish(self, seq: int) -> TokenLogprobs:
        """Request ``seq``'s prompt log-probs (entry 0: NaN, the first token has none); its
        group's prefix rows are dropped with its last member."""
        buf = self._own_buffer(seq)
        row = int(self.prompts.row_ids[seq])
        self._row_left[row] -= 1
        if self._row_left[row]:  # samples of the row still running: they read the same rows
            buf = _Buffer.copy(buf)
        else:
            del self._own[row]
        g, size = int(self.group_of[seq]), int(self.prefix_of[seq])
        if size:
            pre = self._prefix[g]
            buf.lp[1:size], buf.ids[1:size], buf.top[1:size] = pre.lp[1:], pre.ids[1:], pre.top[1:]
        self._left[g] -= 1
        if self._left[g] == 0:
            self._prefix.pop(g, None)
        return TokenLogprobs(logprob=buf.lp, top_ids=buf.ids, top_logprobs=buf.top)
