"""Embedding mode of the native engine (``model.task = "embed"``): pooled final hidden states,
nothing generated.

Every request runs its prompt through the plan as a generation prefill would (its group's
shared prefix computed once, by the group's prefix sequence), and finishes when its last
prompt token is computed: no KV is kept past a row's prefill. ``EmbeddingPooler`` sees every
batch's last-layer hidden states and keeps, per live sequence, only what its pooling needs:

- ``last``: the normed hidden state of the row's last token (always the row's own: every
  member of a group keeps at least one distinct token);
- ``mean``: the sum of the normed hidden states over the row's own tokens; the group prefix's
  sum is kept once per group (computed once, reused by every member) and added at finish,
  so each row's mean is over all of its prompt tokens, as a model run on the row alone gives;
- ``cls``: the normed hidden state of the first token, the prefix's for a group member.

A sequence recomputed after a preemption starts again at own position 0 and resets its
state; a chunk that does not continue where its sequence's state ends (KV that was not
computed in this run) is an error, never a silently wrong embedding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchjob.backends.base import FinishedRequest
from batchjob.backends.native.scheduler.output import SchedulerOutput, prefix_group
from batchjob.model.pooling import PoolingSpec
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts

_NO_TOKENS = np.zeros(0, dtype=np.int32)


class _State:
    """What one sequence's pooling has seen: ``count`` own tokens, and its pooled parts."""

    __slots__ = ("count", "first", "last", "total")

    def __init__(self, hidden: int) -> None:
        self.count = 0
        self.total = np.zeros(hidden, dtype=np.float64)  # mean: the sum so far
        self.first: np.ndarray | None = None  # cls
        self.last: np.ndarray | None = None  # last


def finish_embedding(vec: np.ndarray, spec: PoolingSpec) -> np.ndarray:
    """float32 [D]: ``vec`` cut to ``spec.dimensions``, then L2-normalized if asked (vLLM's
    order, and its ``F.normalize`` eps)."""
    v = np.asarray(vec, dtype=np.float64)
    if spec.dimensions is not None:
        v = v[: spec.dimensions]
    if spec.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype(np.float32)


class EmbeddingPooler:
    """Pools each request of one run (``Engine.embed``) and emits it when it finishes."""

    def __init__(
        self,
        spec: PoolingSpec,
        norm: Callable[[torch.Tensor], torch.Tensor],
        prompts: TokenizedPrompts,
        plan: Plan | None,
        on_finish: Callable[[FinishedRequest], None],
        hidden: int,
    ) -> None:
        self.spec = spec
        self.norm = norm  # the model's final norm: [K, hidden] -> [K, hidden]
        self.prompts = prompts
        self.on_finish = on_finish
        self.hidden = hidden
        n = len(prompts)
        self._group = np.full(n, -1, dtype=np.int64)  # plan group of each request
        self._prefix_len = np.zeros(0, dtype=np.int64)
        self._left = np.zeros(0, dtype=np.int64)  # unfinished members, per group
        if plan is not None and plan.num_groups:
            sizes = np.diff(plan.group_offsets)
            self._group[plan.members] = np.repeat(np.arange(plan.num_groups), sizes)
            self._prefix_len = plan.group_prefix_len.astype(np.int64)
            self._left = sizes.astype(np.int64)
        self._own: dict[int, _State] = {}  # request position -> its state
        self._prefix: dict[int, _State] = {}  # group -> its prefix's state

    def _plen(self, pos: int) -> int:
        g = int(self._group[pos])
        return int(self._prefix_len[g]) if g >= 0 else 0

    def add(self, out: SchedulerOutput, h: torch.Tensor) -> None:
        """One batch: ``h`` [T, hidden] the last layer's hidden states of ``out.chunks``."""
        chunks = out.chunks
        lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        method = self.spec.method
        if method == "mean":  # per-chunk sums of every normed token, one scatter
            x = self.norm(h).float()
            seq = torch.from_numpy(np.repeat(np.arange(len(chunks)), lens)).to(x.device)
            sums = torch.zeros(len(chunks), x.shape[1], dtype=torch.float32, device=x.device)
            rows = sums.index_add_(0, seq, x).cpu().numpy()
            picked = np.arange(len(chunks))
        else:  # cls: a sequence's first token; last: a request's last prompt token
            if method == "cls":
                picked = np.flatnonzero([c.kv_start == 0 for c in chunks])
                at = cu[:-1][picked]
            else:
                ends = [
                    c.seq_id >= 0
                    and c.kv_start + len(c.token_ids) + self._plen(c.seq_id)
                    == int(self.prompts.lengths[c.seq_id])
                    for c in chunks
                ]
                picked = np.flatnonzero(ends)
                at = cu[1:][picked] - 1
            index = torch.from_numpy(at).to(h.device)
            rows = self.norm(h[index]).float().cpu().numpy()
        row_of = dict(zip(picked.tolist(), range(len(picked)), strict=True))
        for i, c in enumerate(chunks):
            st = self._state(c.seq_id, c.kv_start)
            j = row_of.get(i)
            if j is not None:
                if method == "mean":
                    st.total += rows[j]
                elif method == "cls":
                    st.first = rows[j]
                else:
                    st.last = rows[j]
            st.count += int(lens[i])

    def _state(self, seq_id: int, kv_start: int) -> _State:
        """The state of sequence ``seq_id`` (a request, or a group prefix), new at own
        position 0 (a first chunk, or a recompute)."""
        states, key = (self._own, seq_id) if seq_id >= 0 else (self._prefix, prefix_group(seq_id))
        st = states.get(key)
        if kv_start == 0:
            st = states[key] = _State(self.hidden)
        elif st is None or st.count != kv_start:
            seen = 0 if st is None else st.count
            raise RuntimeError(
                f"embedding: sequence {seq_id} continues at own position {kv_start}, but "
                f"{seen} of its tokens were computed in this run (KV reused from elsewhere)"
            )
        return st

    def finish(self, pos: int) -> None:
        """Request ``pos`` computed its whole prompt: pool it and emit its result."""
        st = self._own.pop(pos)
        plen = self._plen(pos)
        own = int(self.prompts.lengths[pos]) - plen
        g = int(self._group[pos])
        pre = self._prefix.get(g) if plen else None
        if st.count != own or (plen and (pre is None or pre.count != plen)):
            raise RuntimeError(f"embedding: request {pos} finished before all its tokens ran")
        method = self.spec.method
        vec: np.ndarray | None
        if method == "mean":
            vec = (st.total + (pre.total if pre is not None else 0.0)) / (own + plen)
        elif method == "cls":
            vec = pre.first if pre is not None else st.first
        else:
            vec = st.last
        if vec is None:
            raise RuntimeError(f"embedding: request {pos} has no {method} token")
        if g >= 0:
            self._left[g] -= 1
            if self._left[g] == 0:
                self._prefix.pop(g, None)  # the group's last member: its prefix state goes
        self.on_finish(
            FinishedRequest(
                position=pos,
                row_id=int(self.prompts.row_ids[pos]),
                token_ids=_NO_TOKENS,
                finish_reason="embed",
                text=None,
                embedding=finish_embedding(vec, self.spec),
            )
        )
