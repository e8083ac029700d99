"""BatchLLM policy: prefix-sharing groups, three token queues, memory-centric batching (Algo 2).

Every iteration fills the token budget ``chunk_size`` from, in order:

1. the decode queue: every running request in decode gets its one token (oldest first);
2. the distinct-prompt queue: first the unfinished prefills of running requests, then the
   waiting members of started groups whose prefix is complete, and recompute chunks of
   preempted requests (those go to the front);
3. the common-prefix queue: the next group in plan order. Its prefix is a sequence of its
   own (``seq_id = -(g + 1)``, ``samples=False``) that owns the prefix blocks; once its last
   chunk has run (``update``), the members join the distinct queue, so a member's tokens are
   never scheduled before its whole prefix. A group with ``prefix_len == 0`` has no prefix
   sequence: starting it puts its members in the distinct queue at once.

Prefill is chunked to the tokens left in the budget and admitted by KV memory only (Algo 2,
no request-count cap): a prefill chunk (distinct, recompute or prefix) runs only if
``blocks in use + blocks it needs <= floor(kv_threshold * num_blocks)``; the chunk is cut to
what fits, and the first one that cannot fit at all ends the prefill pass. Decode tokens are
not capped by the threshold. An iteration that preempted starts no new sequence.

Decode-growth reserve: a new request (or a group start, with its prefix) is admitted only if
the projected KV peak of the running requests, those admitted before it in the pass and it
stays under the threshold, every request growing one token a step for its projected
remaining tokens and freeing its blocks when it finishes (``projected_peak_blocks``, shared
with the vLLM backend's scheduler; kept incrementally here, ``_Projection``). Remaining
tokens are learned from the output lengths of the requests that finished
(``decode_lengths``: the median of a row's final length given how far it has got;
``max_tokens`` until stops are seen, and always where rows run to their limit), so a large
``max_tokens`` cap over short answers does not starve the batch. Decode growth then rarely
overruns the cache: preemption is the exception, not the steady state of a decode-heavy
batch (``scheduler.decode_reserve``, on by default; off: admission by blocks in use alone).

Memory: prefix blocks are allocated chunk by chunk by the prefix sequence, held by the group
and freed when its last member finishes. When a decode needs a block and none is free, the
youngest running request is preempted (its own KV freed; it recomputes its distinct prompt
+ outputs later; the group prefix stays). If that request is the only one running, the
youngest *idle* group (prefix blocks held, no running member) is preempted instead: its
prefix blocks are freed, its waiting members leave the distinct queue and the group goes
back to the front of the prefix queue, to be recomputed (``stats.group_preemptions``).

Group start: a group's prefix starts only if its whole prefix plus one member's prompt fit
under the threshold, counting the prompts of members whose prefix completed earlier in the
same pass (they come first next iteration). This keeps idle prefixes from holding memory.

Progress: if nothing fits under the threshold and no decode runs, the iteration schedules a
single prefill chunk ignoring the threshold (``threshold_lifted``: physical blocks only); if
even that fits nothing, the youngest prefilling request is preempted (or, with one left, the
youngest idle group) until something fits. Every request fits alone with its group prefix
(``check_kv_budget``), so this ends.

Live state: a group's ``_Group`` and its members' ``Sequence`` objects are created when it
reaches the head of the prefix queue and dropped as they finish (the group with its last
member); the queue itself is a cursor over the plan's group order plus the groups put back
in front. Nothing per request or per group exists for the groups not yet reached.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from batchjob.backends.decode_lengths import DecodeLengths, RemainingTable
from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.base import (
    LabelSteps,
    Scheduler,
    check_kv_budget,
    request_prefix_len,
)
from batchjob.backends.native.scheduler.output import (
    ScheduledChunk,
    ScheduledPrefix,
    SchedulerOutput,
    prefix_group,
    prefix_seq_id,
)
from batchjob.backends.native.scheduler.sequence import NEW, RUNNING, WAITING, Sequence
from batchjob.config import SchedulerConfig
from batchjob.plan.intmath import cdiv
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts

_NONE: tuple[None, bool] = (None, False)


class _Group:
    __slots__ = ("index", "members", "num_running", "prefix", "ready", "stamp")

    def __init__(self, index: int, members: dict[int, Sequence], prefix: Sequence | None) -> None:
        self.index = index
        self.members = members  # unfinished members by seq_id, in plan order
        self.prefix = prefix  # the prefix sequence, None when prefix_len == 0
        self.num_running = 0  # members holding own KV
        self.ready = False  # prefix complete (after update) and members released
        self.stamp = -1  # start order: larger is younger


class _GroupQueue:
    """The common-prefix queue without an object per group: the groups put back in front
    (preempted ones), then plan groups ``next, next + 1, ...`` up to ``num_groups``."""

    __slots__ = ("_front", "_next", "_num_groups")

    def __init__(self, num_groups: int) -> None:
        self._front: deque[int] = deque()
        self._next = 0
        self._num_groups = num_groups

    def __bool__(self) -> bool:
        return bool(self._front) or self._next < self._num_groups

    def head(self) -> int:
        return self._front[0] if self._front else self._next

    def popleft(self) -> None:
        if self._front:
            self._front.popleft()
        else:
            self._next += 1

    def appendleft(self, group: int) -> None:
        assert group < self._next  # only a group that left the queue comes back
        self._front.appendleft(group)


def check_plan(plan: Plan, prompts: TokenizedPrompts) -> None:
    """Raise ValueError unless ``plan`` groups exactly ``prompts`` with true shared prefixes."""
    n = len(prompts)
    members = np.asarray(plan.members, dtype=np.int64)
    if len(members) != n or not np.array_equal(np.sort(members), np.arange(n)):
        raise ValueError(f"plan members must be a permutation of the {n} prompt positions")
    off = np.asarray(plan.group_offsets, dtype=np.int64)
    if (
        off.shape != (plan.num_groups + 1,)
        or off[0] != 0
        or off[-1] != n
        or np.any(off[1:] <= off[:-1])
    ):
        raise ValueError("plan group_offsets must rise strictly from 0 to the number of members")
    lengths = prompts.lengths
    for g in range(plan.num_groups):
        ms = members[off[g] : off[g + 1]]
        pl = int(plan.group_prefix_len[g])
        if pl < 0 or pl > int(lengths[ms].min()) - 1:
            raise ValueError(f"plan group {g}: prefix_len {pl} leaves a member no distinct token")
        if pl and len(ms) > 1:
            rows = prompts.tokens[prompts.offsets[ms][:, None] + np.arange(pl)]  # [m, pl]
            if not np.all(rows == rows[:1]):
                raise ValueError(f"plan group {g}: members differ within the {pl}-token prefix")


class BatchLLMScheduler(Scheduler):
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVLayout,
        prompts: TokenizedPrompts,
        plan: Plan | None,
        label_steps: LabelSteps | None = None,
    ) -> None:
        n = len(prompts)
        if plan is not None:
            check_plan(plan, prompts)
        check_kv_budget(kv, prompts, request_prefix_len(plan, n))
        super().__init__(cfg, kv, n, label_steps)
        self._prompts = prompts
        self._plan = plan  # None: groups of one in file order (memory-centric, no sharing)
        num_groups = n if plan is None else plan.num_groups
        self._groups: dict[int, _Group] = {}  # live groups: reached, not all members finished
        self._waiting: deque[Sequence] = deque()  # distinct queue (not yet running)
        self._prefix_queue = _GroupQueue(num_groups)  # common-prefix queue
        self._queued = np.ones(num_groups, dtype=bool)  # group is in the prefix queue
        self._held: dict[int, _Group] = {}  # groups holding prefix blocks
        self._next_group_stamp = 0
        # samples of a row (sampling.n): one prefills its own prompt part, the others copy
        # that KV and compute only their last prompt token (``_sibling``)
        self._samples = prompts.sample_index is not None
        self._row_seqs: dict[int, list[Sequence]] = {}  # live sequences of each sampled row
        self._parked: dict[int, list[Sequence]] = {}  # by the sibling whose prompt they await
        self._copies: list[tuple[list[int], list[int]]] = []  # this pass's (src, dst) blocks
        self._prefilled_now: set[int] = set()  # requests with prompt/recompute chunks this pass
        self._lengths = DecodeLengths()  # finished requests' output lengths (the reserve)

    def _group(self, g: int) -> _Group:
        """Live group ``g``, created (with its members' sequences) on first use."""
        grp = self._groups.get(g)
        if grp is not None:
            return grp
        plan, prompts = self._plan, self._prompts
        if plan is None:
            pl, members = 0, [g]
        else:
            pl = int(plan.group_prefix_len[g])
            members = plan.members[plan.group_offsets[g] : plan.group_offsets[g + 1]].tolist()
        cg = g if pl else -1
        ms: dict[int, Sequence] = {}
        for m in members:
            ms[m] = self._new_request(m, prompts.row(m), int(prompts.max_tokens[m]), pl, g, cg)
            if self._samples:
                self._row_seqs.setdefault(int(prompts.row_ids[m]), []).append(ms[m])
        # a prefix never samples: max_tokens 0
        first = next(iter(ms.values()))
        prefix = Sequence(prefix_seq_id(g), first.prompt[:pl], 0, group=g) if pl else None
        grp = self._groups[g] = _Group(g, ms, prefix)
        return grp

    # --- hooks ----------------------------------------------------------------------------
    def _requeue(self, req: Sequence) -> None:
        self._waiting.appendleft(req)

    def _on_preempt(self, req: Sequence) -> None:
        self._groups[req.group].num_running -= 1

    def _on_finish(self, req: Sequence) -> None:
        if req.steps is None:  # scoring requests run their labels, no open-ended decode
            self._lengths.finished(len(req.outputs), len(req.outputs) >= req.max_tokens)
        if self._samples:
            row = int(self._prompts.row_ids[req.seq_id])
            seqs = self._row_seqs[row]
            seqs.remove(req)
            if not seqs:
                del self._row_seqs[row]
        grp = self._groups[req.group]
        grp.num_running -= 1
        del grp.members[req.seq_id]
        if not grp.members:  # the group is done: drop it
            if grp.prefix is not None:
                self._free_blocks(grp.prefix)
                self._held.pop(grp.index, None)
            del self._groups[grp.index]

    def _scheduled_prefix(self, group: int) -> ScheduledPrefix:
        p = self._groups[group].prefix
        assert p is not None and p.computed == p.num_tokens
        return ScheduledPrefix(group, p.num_tokens, p.block_table())

    def _prefix_chunk_done(self, chunk: ScheduledChunk) -> None:
        grp = self._groups[prefix_group(chunk.seq_id)]
        p = grp.prefix
        if p is not None and not grp.ready and p.computed == p.num_tokens:
            grp.ready = True
            self._c.prefixes_computed += 1
            for m in grp.members.values():  # unfinished: none running while not ready
                m.state = WAITING
                self._waiting.append(m)

    # --- one iteration ----------------------------------------------------------------------
    def _schedule(self) -> tuple[list[ScheduledChunk], bool]:
        self._prefilled_now.clear()
        chunks: list[ScheduledChunk] = []
        budget = self._schedule_decodes(chunks, self.chunk_size)
        allow_new = not self._preempted_now
        self._schedule_prefill(chunks, budget, self.kv_cap_blocks, allow_new, False)
        if chunks:
            return chunks, False
        while True:  # nothing fits under the threshold and no decode: one chunk, all blocks
            self._schedule_prefill(chunks, budget, self.pool.num_blocks, True, True)
            if chunks:
                return chunks, True
            self._preempt_for_progress()

    def _schedule_decodes(self, chunks: list[ScheduledChunk], budget: int) -> int:
        partial = self._partial
        decoding = [r for r in self._running.values() if r.outputs and r.seq_id not in partial]
        bs = self.block_size
        for req in decoding:
            if budget == 0:
                break
            if req.state != RUNNING:  # preempted as a victim earlier in this pass
                continue
            if req.computed == len(req.blocks) * bs and not self._grow_decode(req):
                continue  # needed a block; preempted itself
            chunks.append(self._emit_decode(req))
            budget -= 1
        return budget

    def _grow_decode(self, req: Sequence) -> bool:
        """A block for ``req``'s next token; False if ``req`` was preempted."""
        while self.pool.num_free == 0:
            victim = self._youngest_running()
            if victim is req and len(self._running) == 1:
                self._preempt_group(self._youngest_idle_group(exclude=req.group))
                continue
            self._preempt(victim)
            if victim is req:
                return False
        req.blocks += self.pool.allocate(1)
        return True

    def _schedule_prefill(
        self, chunks: list[ScheduledChunk], budget: int, cap: int, allow_new: bool, one: bool
    ) -> None:
        """Distinct then prefix queue under ``cap`` blocks; ``one``: stop after one chunk."""
        # distinct queue, active part: running requests with prompt/recompute tokens left
        # (``_partial``, in admission order: no scan of the requests in decode)
        for req in list(self._partial.values()):
            if budget == 0:
                return
            left = req.num_tokens - req.computed
            n = self._reserve(req, left, budget, cap)
            if n == 0:
                return
            self._prefilled_now.add(req.seq_id)
            chunks.append(self._emit(req, n))
            budget -= n
            if one:
                return
        if not allow_new:
            return
        # the lifted pass only needs progress: no reserve there
        growth = _GrowthReserve(self) if self.cfg.decode_reserve and not one else None
        seqs = self.cfg.running_cap
        while budget > 0:
            if self._waiting:  # distinct queue, waiting part
                req = self._waiting[0]
                # a sample not started yet may take a sibling's prompt KV (a preempted one
                # recomputes its prompt and outputs itself)
                donor, ready = self._sibling(req) if self._samples and not req.outputs else _NONE
                if donor is not None and not ready:  # its prompt is under way: wait for it
                    self._waiting.popleft()
                    self._parked.setdefault(donor.seq_id, []).append(req)
                    continue
                if seqs is not None and len(self._running) >= seqs:  # scheduler.max_num_seqs
                    return
                if growth is not None and not growth.admit(req, 0, cap):
                    return
                if donor is not None:  # copy the sibling's own prompt KV, compute one token
                    n = self._copy_prompt(req, donor, budget, cap)
                else:
                    n = self._reserve(req, req.num_tokens, budget, cap)
                if n == 0:
                    return
                self._waiting.popleft()
                self._admit(req)
                self._groups[req.group].num_running += 1
                self._prefilled_now.add(req.seq_id)
                chunks.append(self._emit(req, n))
                budget -= n
                if one:
                    return
                continue
            if not self._prefix_queue:
                return
            grp = self._group(self._prefix_queue.head())
            p = grp.prefix
            if p is None:  # no shared prefix: its members join the distinct queue now
                first = next(iter(grp.members.values()))
                if self._fit(first, first.num_tokens, budget, cap) == 0:
                    return
                self._start_group(grp)
                for m in grp.members.values():
                    m.state = WAITING
                    self._waiting.append(m)
                continue
            if grp.stamp < 0 and not self._room_to_start(grp, cap, growth):
                return
            n = self._reserve(p, p.num_tokens - p.computed, budget, cap)
            if n == 0:
                return
            if grp.stamp < 0:
                self._start_group(grp)
            chunks.append(self._emit(p, n))
            budget -= n
            if p.computed < p.num_tokens:
                return  # budget or memory exhausted mid-prefix
            self._prefix_queue.popleft()
            self._queued[grp.index] = False
            # its members join the distinct queue next iteration, ahead of anything started
            # now: keep their prompts' blocks free of later prefill in this pass
            cap -= sum(self._prompt_blocks(m) for m in grp.members.values())
            if one:
                return

    # --- samples of a row ---------------------------------------------------------------------
    def _sibling(self, req: Sequence) -> tuple[Sequence | None, bool]:
        """A running sample of ``req``'s row to copy from: one whose own prompt KV is in the
        cache (it has sampled, and no prompt or recompute chunk of it is pending or in this
        pass) first (True), else one still prefilling (False: ``req`` waits for it); None:
        ``req`` prefills itself."""
        prefilling = None
        for sib in self._row_seqs.get(int(self._prompts.row_ids[req.seq_id]), ()):
            if sib is req or sib.state != RUNNING:
                continue
            sid = sib.seq_id
            if sib.outputs and sid not in self._partial and sid not in self._prefilled_now:
                return sib, True
            prefilling = sib
        return prefilling, False

    def _copy_prompt(self, req: Sequence, donor: Sequence, budget: int, cap: int) -> int:
        """Admit-side of a copy: ``req`` holds blocks for its whole own prompt, the first
        ``own - 1`` tokens' KV copied from ``donor`` before the forward; returns the tokens
        to emit (1: the last prompt token, whose logits ``req`` samples from) or 0."""
        own = req.num_tokens  # a new request: its own prompt, nothing sampled yet
        k = own - 1
        req.computed = k
        n = self._reserve(req, 1, budget, cap)
        if n <= 0:
            req.computed = 0
            return 0
        nb = cdiv(k, self.block_size)
        if nb:
            self._copies.append((donor.blocks[:nb], req.blocks[:nb]))
        req.high_water = max(req.high_water, k)
        self._c.copied_tokens += k
        return n

    def _take_copies(self) -> tuple[np.ndarray, np.ndarray] | None:
        if not self._copies:
            return None
        src = np.concatenate([np.asarray(s, dtype=np.int32) for s, _ in self._copies])
        dst = np.concatenate([np.asarray(d, dtype=np.int32) for _, d in self._copies])
        self._copies = []
        return src, dst

    def update(
        self, out: SchedulerOutput, sampled: dict[int, int], finished: set[int]
    ) -> dict[int, list[int]]:
        done = super().update(out, sampled, finished)
        for sid in list(self._parked):  # waiting for a sibling that has sampled, or stopped
            sib = self._live.get(sid)
            if sib is None or sib.state != RUNNING or (sib.outputs and sid not in self._partial):
                for req in reversed(self._parked.pop(sid)):
                    self._waiting.appendleft(req)
        return done

    # --- memory -----------------------------------------------------------------------------
    def _fit(self, seq: Sequence, left: int, budget: int, cap: int) -> int:
        """Tokens of ``seq`` (up to ``left``) that fit the budget and ``cap`` blocks in use."""
        used = self.pool.num_used
        if used > cap:
            return 0
        slack = len(seq.blocks) * self.block_size - seq.computed
        new_blocks = min(cap - used, self.pool.num_free)
        return min(left, budget, slack + new_blocks * self.block_size)

    def _reserve(self, seq: Sequence, left: int, budget: int, cap: int) -> int:
        n = self._fit(seq, left, budget, cap)
        if n:
            seq.blocks += self.pool.allocate(self._blocks_to_add(seq, n))
        return n

    def _room_to_start(self, grp: _Group, cap: int, growth: _GrowthReserve | None) -> bool:
        """Start a group only if its whole prefix and one member's prompt fit under ``cap``
        (with ``growth``: and that member's decode growth, on top of the running requests').

        A prefix is useless until a member runs: starting one that no member can follow
        would only hold blocks (and invite a group preemption later).
        """
        assert grp.prefix is not None
        first = next(iter(grp.members.values()))
        prefix_blocks = cdiv(grp.prefix.num_tokens, self.block_size)
        if growth is not None:
            return growth.fits(first, prefix_blocks, cap)
        return self.pool.num_used + prefix_blocks + self._prompt_blocks(first) <= cap

    def _prompt_blocks(self, req: Sequence) -> int:
        return cdiv(req.num_tokens, self.block_size)

    def _start_group(self, grp: _Group) -> None:
        grp.stamp = self._next_group_stamp
        self._next_group_stamp += 1
        if grp.prefix is None:
            self._prefix_queue.popleft()
            self._queued[grp.index] = False
        else:
            self._held[grp.index] = grp

    def _youngest_idle_group(self, exclude: int) -> _Group:
        idle = [
            g
            for g in self._held.values()
            if g.num_running == 0 and g.index != exclude and g.prefix and g.prefix.blocks
        ]
        if not idle:
            raise RuntimeError("internal error: KV memory full with nothing left to preempt")
        return max(idle, key=lambda g: g.stamp)

    def _preempt_group(self, grp: _Group) -> None:
        """Drop an idle group's prefix KV; the group restarts from the prefix queue."""
        assert grp.prefix is not None and grp.num_running == 0
        self._free_blocks(grp.prefix)
        del self._held[grp.index]
        grp.ready = False
        grp.stamp = -1
        ids = grp.members
        self._waiting = deque(r for r in self._waiting if r.seq_id not in ids)
        for sid in [s for s in self._parked if s in ids]:  # their sibling went with the group
            for req in self._parked.pop(sid):
                req.state = NEW
        for m in grp.members.values():
            if m.state == WAITING:
                m.state = NEW  # waits for the prefix again
        if not self._queued[grp.index]:
            self._prefix_queue.appendleft(grp.index)
            self._queued[grp.index] = True
        self._c.group_preemptions += 1
        self._preempted_now.append(grp.prefix.seq_id)

    def _preempt_for_progress(self) -> None:
        """Free memory when not even the threshold-free pass could schedule anything."""
        if len(self._running) > 1:
            self._preempt(self._youngest_running())
            return
        if self._running:
            head = self._youngest_running().group
        elif self._waiting:
            head = self._waiting[0].group
        else:
            head = self._prefix_queue.head() if self._prefix_queue else -1
        self._preempt_group(self._youngest_idle_group(exclude=head))


class _GrowthReserve:
    """Admission with a decode-growth reserve, for one prefill pass: a new request is admitted
    only if the projected KV peak (``projected_peak_blocks``: each running request grows one
    token a step for its projected remaining tokens and frees its own blocks when it
    finishes) of the running requests, those admitted earlier in the pass and it, plus the
    blocks no request owns (group prefixes), stays under ``cap``. Preemption is then the
    exception. Remaining tokens: learned from the lengths of the requests that finished
    (``decode_lengths``), the request's ``max_tokens`` until they say otherwise.

    The projection is kept incrementally (``_Projection``): built once per pass over the
    running requests, then each candidate costs O(distinct finish steps), not O(running)."""

    def __init__(self, sched: BatchLLMScheduler) -> None:
        self._sched = sched
        self._proj: _Projection | None = None  # built on first use
        self._est = _LIMITS  # the learned estimate, with the projection
        self._own = 0  # blocks owned by the requests running at the start of the pass
        self._admitted: list[Sequence] = []  # admitted in this pass

    def fits(self, req: Sequence, extra_blocks: int, cap: int) -> bool:
        """Whether ``req`` (plus ``extra_blocks`` not yet allocated) keeps the peak <= cap."""
        s = self._sched
        if self._proj is None:
            run = list(s._running.values())
            tok = np.fromiter(map(_grown_from, run), np.int64, len(run))  # prefill whole
            out = np.fromiter((len(r.outputs) for r in run), np.int64, len(run))
            self._est = s._lengths.table(out)
            rem = np.fromiter((_remaining(r, self._est) for r in run), np.int64, len(run))
            self._proj = _Projection(tok, rem, s.block_size)
            self._own = sum(len(r.blocks) for r in run)
        # blocks no request owns: group prefixes, those started in this pass included
        base = s.pool.num_used - self._own - sum(len(r.blocks) for r in self._admitted)
        peak = self._proj.peak_with(_grown_from(req), _remaining(req, self._est))
        return base + extra_blocks + peak <= cap

    def admit(self, req: Sequence, extra_blocks: int, cap: int) -> bool:
        """``fits``, and if so count ``req`` as running for the rest of the pass."""
        if not self.fits(req, extra_blocks, cap):
            return False
        assert self._proj is not None
        self._proj.add(_grown_from(req), _remaining(req, self._est))
        self._admitted.append(req)
        return True


def _grown_from(req: Sequence) -> int:
    """Own tokens the decode growth starts from: the prompt and outputs. A scoring request's
    label path is left out: its ``max_tokens`` (the longest label) already counts it."""
    return req.num_own_prompt + len(req.outputs)


_LIMITS = RemainingTable(None)  # nothing learned: every request to its max_tokens


def _remaining(req: Sequence, est: RemainingTable) -> int:
    """Decode tokens ``req`` is projected to add: the learned estimate (scoring requests,
    whose labels are known: their ``max_tokens``)."""
    table = est if req.steps is None else _LIMITS
    return table.remaining(len(req.outputs), req.max_tokens)


class _Projection:
    """``projected_peak_blocks(tok, rem, 0, block_size)`` of a growing set of requests, kept
    as the blocks they own at each step where one of them is about to finish (the only steps
    where the peak can be): adding a request or asking for the peak with one more is
    O(steps), plus O(requests) when its finish step is new."""

    def __init__(self, tok: np.ndarray, rem: np.ndarray, block_size: int) -> None:
        self.tok, self.rem, self.bs = tok, rem, block_size
        self.steps = np.unique(rem) - 1  # sorted
        self.load = self._load(self.steps)  # [T]: blocks owned just before each step's finish

    def _load(self, steps: np.ndarray) -> np.ndarray:
        alive = self.rem[None, :] > steps[:, None]
        own = cdiv(self.tok[None, :] + steps[:, None], self.bs)
        return np.where(alive, own, 0).sum(axis=1).astype(np.int64)

    def _one(self, tok: int, rem: int, steps: np.ndarray) -> np.ndarray:
        return np.where(rem > steps, cdiv(tok + steps, self.bs), 0)

    def peak_with(self, tok: int, rem: int) -> int:
        """The projected peak of the set plus a request with ``tok`` tokens, ``rem`` to go."""
        peak = int((self.load + self._one(tok, rem, self.steps)).max(initial=0))
        t = rem - 1
        i = int(np.searchsorted(self.steps, t))
        if i == len(self.steps) or self.steps[i] != t:  # its own finish step is a new one
            at = np.asarray([t], dtype=np.int64)
            peak = max(peak, int(self._load(at)[0]) + cdiv(tok + t, self.bs))
        return peak

    def add(self, tok: int, rem: int) -> None:
        t = rem - 1
        i = int(np.searchsorted(self.steps, t))
        if i == len(self.steps) or self.steps[i] != t:
            at = np.asarray([t], dtype=np.int64)
            self.steps = np.insert(self.steps, i, t)
            self.load = np.insert(self.load, i, self._load(at)[0])
        self.load = self.load + self._one(tok, rem, self.steps)
        self.tok = np.append(self.tok, tok)
        self.rem = np.append(self.rem, rem)
