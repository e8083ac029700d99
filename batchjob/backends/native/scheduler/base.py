"""The parts both scheduling policies share: KV budget check, counters, schedule/update.

A scheduler takes the job's ``SchedulerConfig`` as is (validated at load time) and the
engine's ``KVLayout`` (the block count it derived from its memory, and ``engine.block_size``).

Protocol (the runner's loop)::

    sched = make_scheduler(cfg, kv, prompts, plan)
    while sched.has_unfinished():
        out = sched.schedule()          # SchedulerOutput: chunks, block tables, prefixes
        ...                             # run the model; sample one token per chunk.samples
        done = sched.update(out, sampled={seq_id: token}, finished={seq_id, ...})

``schedule`` and ``update`` alternate strictly. A request's state advances at ``schedule``
(its KV is counted as computed once scheduled); ``update`` appends the sampled tokens and
retires finished requests, returning their outputs (``{seq_id: tokens}``). A request also
finishes when it has ``max_tokens`` outputs, whether or not the runner says so.

Scoring (``label_steps``, one per request, ``batchjob.backends.scoring._Trie.steps``): a request
samples nothing. Its chunks carry ``score_nodes`` (the runner reads the logits of those
trailing tokens and passes ``sampled={}``). The first step is scheduled with the prompt (one
prefill; the root is read at the prompt's last token). When a chunk completes a step,
``update`` starts the next one: the request's own KV is rewound to the step's branch point
(the blocks past it freed, ``computed`` set back) and the step's path tokens become prompt
work again; after the last step the request finishes (``update`` returns it with no tokens).
A preempted scoring request recomputes its prompt and the current step's path. KV: such a
request holds at most its prompt + the longest label - 1 tokens, which is what
``prompts.max_tokens`` = the longest label makes ``check_kv_budget`` and the admission
reserve count.

Memory: a request's ``Sequence`` (its mutable state) exists only while it is live: created
when its group comes up for scheduling (batchllm: at the head of the prefix queue; baseline:
at the head of the waiting line) and dropped when it finishes, its outputs handed back by
``update``. Per-row data stays in ``TokenizedPrompts`` / the plan's numpy arrays, so live
Python objects grow with the running set, not with the dataset.
Pure Python + numpy: never import torch here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, fields

import numpy as np

from batchjob.backends.native.kv_cache import BlockPool, KVLayout
from batchjob.backends.native.scheduler.output import (
    ScheduledChunk,
    ScheduledPrefix,
    SchedulerOutput,
    SchedulerStats,
)
from batchjob.backends.native.scheduler.sequence import FINISHED, RUNNING, WAITING, Sequence
from batchjob.config import SchedulerConfig
from batchjob.plan.intmath import cdiv
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts

# scoring: per request, its steps (base, path int32, nodes int64), ``batchjob.backends.scoring``
LabelSteps = SequenceOf[tuple[tuple[int, np.ndarray, np.ndarray], ...]]

NATIVE_CHUNK_SIZE = 2048  # scheduler.chunk_size unset: the budget tuned on 2-core CPUs


@dataclass
class _Counters:
    iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_tokens: int = 0
    recomputed_tokens: int = 0
    cache_hit_tokens: int = 0
    preemptions: int = 0
    group_preemptions: int = 0
    prefixes_computed: int = 0
    peak_blocks: int = 0
    threshold_lifted_iterations: int = 0
    copied_tokens: int = 0


def request_prefix_len(plan: Plan | None, num_requests: int) -> np.ndarray:
    """int64 [N]: the group prefix length each request attends to (0 without a plan)."""
    per_req = np.zeros(num_requests, dtype=np.int64)
    if plan is not None:
        per_req[plan.members] = np.repeat(plan.group_prefix_len, np.diff(plan.group_offsets))
    return per_req


def kv_blocks_needed(kv: KVLayout, prompts: TokenizedPrompts, prefix_len: np.ndarray) -> np.ndarray:
    """int64 [N]: blocks each request needs alone (group prefix + own prompt + outputs - 1)."""
    own = prompts.lengths - prefix_len
    mt = prompts.max_tokens.astype(np.int64)
    return cdiv(prefix_len, kv.block_size) + cdiv(own + mt - 1, kv.block_size)


def check_kv_budget(kv: KVLayout, prompts: TokenizedPrompts, prefix_len: np.ndarray) -> None:
    """Raise ValueError unless every request fits alone: its group prefix + own prompt + outputs.

    ``prefix_len``: int64 [N], the group prefix length of each prompt (0 for none).
    """
    bs, nb = kv.block_size, kv.num_blocks
    lengths = prompts.lengths
    if len(prompts) and lengths.min() < 1:
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty")
    if len(prompts) and prompts.max_tokens.min() < 1:
        raise ValueError(f"max_tokens must be >= 1 (prompt {int(np.argmin(prompts.max_tokens))})")
    if not len(prompts):
        return
    own = lengths - prefix_len
    mt = prompts.max_tokens.astype(np.int64)
    prefix_blocks = cdiv(prefix_len, bs)
    own_blocks = cdiv(own + mt - 1, bs)  # the last sampled token never gets KV
    need = kv_blocks_needed(kv, prompts, prefix_len)
    i = int(np.argmax(need))
    if need[i] > nb:
        raise ValueError(
            f"KV budget too small: prompt {i} (row_id {int(prompts.row_ids[i])}) needs "
            f"{int(need[i])} blocks of {bs} tokens = group prefix {int(prefix_len[i])} tokens "
            f"({int(prefix_blocks[i])} blocks) + own prompt {int(own[i])} tokens + max_tokens "
            f"{int(mt[i])} - 1 ({int(own_blocks[i])} blocks), but num_blocks is {nb}; "
            "give the engine more KV memory or lower max_tokens"
        )


class Scheduler(ABC):
    """Common state and the schedule/update protocol; policies fill ``_schedule``."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVLayout,
        num_requests: int,
        label_steps: LabelSteps | None = None,
    ) -> None:
        self.cfg = cfg
        self.chunk_size = cfg.chunk_size or NATIVE_CHUNK_SIZE  # tokens per iteration
        self._label_steps = label_steps  # scoring: per request, its teacher-forced steps
        self.block_size = kv.block_size
        self.kv_cap_blocks = cfg.kv_cap_blocks(kv.num_blocks)  # no new prefill above it
        self.pool = BlockPool(kv.num_blocks)
        self._live: dict[int, Sequence] = {}  # requests created and not finished, by seq_id
        self._running: dict[int, Sequence] = {}  # running requests, oldest admission first
        self._num_unfinished = num_requests
        self._pending: SchedulerOutput | None = None
        self._samplers: dict[int, None] = {}  # sampling seq_ids of the pending output
        self._partial: dict[int, Sequence] = {}  # running, own prompt not all scheduled yet
        self._preempted_now: list[int] = []
        self._next_stamp = 0
        self._c = _Counters()

    # --- public API ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self._num_unfinished > 0

    @property
    def kv_blocks_used(self) -> int:
        return self.pool.num_used

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(**{f.name: getattr(self._c, f.name) for f in fields(self._c)})

    @property
    def num_live(self) -> int:
        """Requests with a ``Sequence`` now (created, not finished): bounded by the running set
        and the groups in flight, not by the number of requests."""
        return len(self._live)

    def output_tokens(self, seq_id: int) -> list[int]:
        """Tokens sampled so far for live request ``seq_id`` (a copy). A finished request's
        tokens are what ``update`` returned when it finished: its state is gone."""
        req = self._live.get(seq_id)
        if req is None:
            raise KeyError(
                f"request {seq_id} is not live (not started yet, or finished: update() "
                "returned its tokens)"
            )
        return list(req.outputs)

    def schedule(self) -> SchedulerOutput:
        if self._pending is not None:
            raise RuntimeError("schedule() called again before update() of the last output")
        if not self.has_unfinished():
            raise RuntimeError("schedule() called with no unfinished request")
        self._preempted_now = []
        chunks, lifted = self._schedule()
        if not chunks:
            raise RuntimeError("internal error: scheduler made no progress")
        chunks, groups, samplers, n_dec, n_all = _collate(chunks)
        used = self.pool.num_used
        c = self._c
        c.peak_blocks = max(c.peak_blocks, used)
        c.threshold_lifted_iterations += int(lifted)
        out = SchedulerOutput(
            chunks=tuple(chunks),
            prefixes=tuple(self._scheduled_prefix(g) for g in groups),
            num_decode_tokens=n_dec,
            num_prefill_tokens=n_all - n_dec,
            kv_blocks_used=used,
            kv_blocks_total=self.pool.num_blocks,
            preempted=tuple(self._preempted_now),
            iteration=c.iterations,
            threshold_lifted=lifted,
            kv_copies=self._take_copies(),
        )
        self._samplers = samplers
        c.iterations += 1
        self._pending = out
        return out

    def update(
        self, out: SchedulerOutput, sampled: dict[int, int], finished: set[int]
    ) -> dict[int, list[int]]:
        """Record one sampled token per sampling chunk of ``out``; retire finished requests
        (those in ``finished`` and those at ``max_tokens``) and return their outputs
        ``{seq_id: tokens}``: their state is dropped, so this is the only place to get them."""
        if out is not self._pending:
            raise ValueError("update() must get the output of the last schedule() call")
        samplers = self._samplers  # seq_ids of the sampling chunks, in chunk order
        if len(sampled) != len(samplers) or sampled.keys() != samplers.keys():
            sampling = set(samplers)
            raise ValueError(
                f"sampled must have exactly the sampling seq_ids: missing "
                f"{sorted(sampling - set(sampled))}, unexpected {sorted(set(sampled) - sampling)}"
            )
        if not finished <= samplers.keys():
            extra = sorted(finished - set(samplers))
            raise ValueError(f"finished seq_ids that did not sample: {extra}")
        self._pending = None
        live = self._live
        done: dict[int, list[int]] = {}
        for chunk in out.chunks:  # prefix chunks: a few per iteration at most
            if chunk.seq_id < 0:
                self._prefix_chunk_done(chunk)
            elif chunk.score_nodes is not None:
                req = live[chunk.seq_id]
                if req.state == RUNNING and req.computed == req.num_tokens:  # step complete
                    if self._next_label_step(req):
                        continue
                    self._finish(req)
                    done[req.seq_id] = req.outputs
        for seq_id in samplers:
            req = live[seq_id]
            req.outputs.append(int(sampled[seq_id]))
            if seq_id in finished or len(req.outputs) >= req.max_tokens:
                self._finish(req)
                done[seq_id] = req.outputs
        return done

    # --- policy hooks -------------------------------------------------------------------
    @abstractmethod
    def _schedule(self) -> tuple[list[ScheduledChunk], bool]:
        """Chunks of this iteration (any order) and whether kv_threshold was lifted."""

    @abstractmethod
    def _requeue(self, req: Sequence) -> None:
        """Put a just-preempted request back in line."""

    def _scheduled_prefix(self, group: int) -> ScheduledPrefix:
        raise NotImplementedError

    def _prefix_chunk_done(self, chunk: ScheduledChunk) -> None:
        raise NotImplementedError

    def _on_finish(self, req: Sequence) -> None:  # noqa: B027 (optional hook)
        pass

    def _take_copies(self) -> tuple[np.ndarray, np.ndarray] | None:
        """KV block copies this pass scheduled (src, dst), then forgotten; None: none."""
        return None

    def _on_preempt(self, req: Sequence) -> None:  # noqa: B027 (optional hook)
        pass

    # --- shared mechanics ---------------------------------------------------------------
    def _new_request(
        self,
        seq_id: int,
        prompt: np.ndarray,
        max_tokens: int,
        own_start: int = 0,
        group: int = -1,
        chunk_group: int = -1,
    ) -> Sequence:
        """The ``Sequence`` of request ``seq_id``, created when it comes up (kept until it
        finishes)."""
        req = Sequence(seq_id, prompt, max_tokens, own_start, group, chunk_group)
        if self._label_steps is not None:
            req.start_scoring(self._label_steps[seq_id])
        self._live[seq_id] = req
        return req

    def _blocks_to_add(self, seq: Sequence, n: int) -> int:
        """New blocks ``seq`` needs to hold ``n`` more own KV tokens."""
        return cdiv(seq.computed + n, self.block_size) - len(seq.blocks)

    def _admit(self, req: Sequence) -> None:
        req.state = RUNNING
        req.stamp = self._next_stamp
        self._next_stamp += 1
        self._running[req.seq_id] = req

    def _youngest_running(self) -> Sequence:
        return self._running[next(reversed(self._running))]

    def _free_blocks(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.blocks))  # last block first: evicted first
        seq.blocks = []
        seq._table = None
        seq.computed = 0
        seq.num_cached_blocks = 0

    def _emit_decode(self, seq: Sequence) -> ScheduledChunk:
        """``_emit(seq, 1)`` for a request in decode (its latest sampled token)."""
        start = seq.computed
        c = self._c
        c.decode_tokens += 1
        if seq.high_water > start:
            c.recomputed_tokens += 1
        else:
            seq.high_water = start + 1
        seq.computed = start + 1
        return ScheduledChunk(  # positional: seq_id, token_ids, kv_start, position_start,
            seq.seq_id,  # block_table, group, is_decode, samples
            np.array(seq.outputs[-1:], dtype=np.int32),
            start,
            seq.own_start + start,
            seq.block_table(),
            seq.chunk_group,
            True,
            True,
        )

    def _preempt(self, req: Sequence) -> None:
        """Recompute preemption: drop the request's own KV and put it back in line."""
        self._free_blocks(req)
        self._partial.pop(req.seq_id, None)
        del self._running[req.seq_id]
        req.state = WAITING
        self._c.preemptions += 1
        self._preempted_now.append(req.seq_id)
        self._on_preempt(req)
        self._requeue(req)

    def _next_label_step(self, req: Sequence) -> bool:
        """Scoring: rewind ``req``'s own KV to the next step's branch point (freeing the
        blocks past it) and queue the step's path tokens; False when no step is left."""
        if not req.next_step():
            return False
        keep_tokens = req.score_from  # num_own_prompt + base <= what the KV holds
        keep = cdiv(keep_tokens, self.block_size)
        if len(req.blocks) > keep:
            self.pool.free(reversed(req.blocks[keep:]))
            del req.blocks[keep:]
        req._table = None  # the tail blocks change even when their count does not
        req.computed = keep_tokens
        req.high_water = keep_tokens  # the positions past it get new tokens: not a recompute
        self._partial[req.seq_id] = req
        return True

    def _finish(self, req: Sequence) -> None:
        self._free_blocks(req)
        self._partial.pop(req.seq_id, None)
        del self._running[req.seq_id]
        del self._live[req.seq_id]
        req.state = FINISHED
        self._num_unfinished -= 1
        self._on_finish(req)

    def _emit(self, seq: Sequence, n: int) -> ScheduledChunk:
        """Schedule own tokens [computed, computed + n) of ``seq`` (blocks already held)."""
        start, end = seq.computed, seq.computed + n
        num_tokens = seq.num_tokens
        # blocks are allocated exactly as needed: the table covers the KV after this chunk
        assert n > 0 and end <= num_tokens and len(seq.blocks) == cdiv(end, self.block_size)
        is_decode = n == 1 and bool(seq.outputs) and end == num_tokens
        c = self._c
        if is_decode:
            c.decode_tokens += 1
        else:
            c.prefill_tokens += n
        if seq.seq_id < 0:
            c.prefix_tokens += n
        c.recomputed_tokens += max(0, min(end, seq.high_water) - start)
        seq.high_water = max(seq.high_water, end)
        seq.computed = end
        if seq.seq_id >= 0:
            if end < num_tokens:
                self._partial[seq.seq_id] = seq  # keeps its place (admission order) if there
            else:
                self._partial.pop(seq.seq_id, None)
        if seq.steps is not None:  # scoring: read the logits of positions score_from ..
            f = seq.score_from
            lo = max(start, f)
            return ScheduledChunk(
                seq.seq_id,
                seq.tokens(start, end),
                start,
                seq.own_start + start,
                seq.block_table(),
                seq.chunk_group,
                False,
                False,
                seq.score_nodes[lo - f : end - f] if lo < end else None,
            )
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.tokens(start, end),
            kv_start=start,
            position_start=seq.own_start + start,
            block_table=seq.block_table(),
            group=seq.chunk_group,
            is_decode=is_decode,
            samples=seq.seq_id >= 0 and end == num_tokens,
        )


def _collate(
    chunks: list[ScheduledChunk],
) -> tuple[list[ScheduledChunk], list[int], dict[int, None], int, int]:
    """One pass: chunks stably reordered so those of a group (>= 0) are adjacent, the groups
    in order of appearance, the sampling seq_ids in the new order, decode and all tokens."""
    buckets: dict[int, list[ScheduledChunk]] = {}
    n_dec = n_all = 0
    for i, c in enumerate(chunks):
        g = c.group
        key = g if g >= 0 else -1 - i  # a chunk of no group: a bucket of its own
        b = buckets.get(key)
        if b is None:
            buckets[key] = [c]
        else:
            b.append(c)
        n = len(c.token_ids)
        n_all += n
        if c.is_decode:
            n_dec += n
    if len(buckets) == len(chunks):
        ordered = chunks  # no group has two chunks: nothing moves
    else:
        ordered = [c for bucket in buckets.values() for c in bucket]
    groups = [k for k in buckets if k >= 0]
    samplers = dict.fromkeys(c.seq_id for c in ordered if c.samples)
    return ordered, groups, samplers, n_dec, n_all
