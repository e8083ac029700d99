"""Baseline policy: vLLM v1's scheduling choices on our engine (the ablation).

* Requests in file order (prompt position), one at a time: the plan is ignored.
* Each iteration first serves the running requests, oldest first (a decode token each, or
  the next chunk of an unfinished prefill), then admits waiting requests (preempted ones
  first) while the token budget lasts and fewer than ``max_num_seqs`` run.
* Blocks are allocated per chunk. A waiting request is admitted only if its chunk's blocks
  can be allocated now (free blocks include evictable cached ones); otherwise admission stops.
* When a running request cannot get a block, the youngest running request is preempted by
  recompute (possibly the request itself, which ends the running pass); an iteration that
  preempted admits nobody.
* LRU block-level prefix cache: full blocks are registered under a chained hash when
  scheduled (the runner writes a batch's KV before attention reads it, so a hit on a block
  filled in the same batch is sound). A new or resumed request reuses the longest cached run
  of its full blocks, but never its last known token, which is always recomputed for logits.
  A hit shows as ``kv_start > 0`` on its first chunk. ``kv_threshold`` is not used.
  Scoring requests cache their prompt's full blocks only (their label part is rewound) and
  reuse at most up to their first scored position (whose logits must be computed).
* A request's ``Sequence`` is created when it reaches the head of the waiting line and
  dropped when it finishes: live objects follow the running set, not the dataset.
"""

from __future__ import annotations

from collections import deque

from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.base import LabelSteps, Scheduler, check_kv_budget
from batchjob.backends.native.scheduler.output import ScheduledChunk
from batchjob.backends.native.scheduler.sequence import RUNNING, WAITING, Sequence
from batchjob.config import SchedulerConfig
from batchjob.plan.intmath import cdiv
from batchjob.tokenize.prompts import TokenizedPrompts


class BaselineScheduler(Scheduler):
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVLayout,
        prompts: TokenizedPrompts,
        label_steps: LabelSteps | None = None,
    ) -> None:
        check_kv_budget(kv, prompts, prefix_len=prompts.lengths * 0)
        super().__init__(cfg, kv, len(prompts), label_steps)
        self._prompts = prompts
        self._next_new = 0  # the first request never created (file order)
        # the waiting line: preempted requests (front), then at most one new request looked
        # at but not admitted; requests from ``_next_new`` on follow, not yet created
        self._waiting: deque[Sequence] = deque()

    def _requeue(self, req: Sequence) -> None:
        self._waiting.appendleft(req)

    def _head(self) -> Sequence | None:
        """The first waiting request (created now if it is a new one); None: none left."""
        if self._waiting:
            return self._waiting[0]
        i = self._next_new
        if i == len(self._prompts):
            return None
        self._next_new = i + 1
        req = self._new_request(i, self._prompts.row(i), int(self._prompts.max_tokens[i]))
        req.state = WAITING
        self._waiting.append(req)
        return req

    def _schedule(self) -> tuple[list[ScheduledChunk], bool]:
        budget = self.chunk_size
        chunks: list[ScheduledChunk] = []
        for req in list(self._running.values()):
            if budget == 0:
                break
            if req.state != RUNNING:  # preempted earlier in this pass
                continue
            n = min(req.num_tokens - req.computed, budget)
            if not self._grow_or_preempt(req, n):
                break
            chunks.append(self._emit_and_cache(req, n))
            budget -= n
        if self._preempted_now:
            return chunks, False
        while budget > 0 and len(self._running) < (self.cfg.running_cap or 0):
            head = self._head()
            if head is None:
                break
            n = self._admit_with_cache(head, budget)
            if n == 0:
                break
            self._waiting.popleft()
            chunks.append(self._emit_and_cache(head, n))
            budget -= n
        return chunks, False

    def _grow_or_preempt(self, req: Sequence, n: int) -> bool:
        """Give ``req`` blocks for ``n`` more tokens, preempting the youngest as needed."""
        need = self._blocks_to_add(req, n)
        while need > self.pool.num_free:
            victim = self._youngest_running()
            self._preempt(victim)
            if victim is req:
                return False
        req.blocks += self.pool.allocate(need)
        return True

    def _admit_with_cache(self, req: Sequence, budget: int) -> int:
        """Admit ``req`` with its cached blocks and a first chunk; its size, or 0 if no room."""
        bs = self.block_size
        known = req.num_tokens - 1 if req.steps is None else min(req.score_from, req.num_own_prompt)
        hits = self.pool.lookup(req.block_hashes(known // bs, bs))
        cached = len(hits) * bs
        n = min(req.num_tokens - cached, budget)
        need = cdiv(cached + n, bs) - len(hits)
        if need > self.pool.num_free - self.pool.num_evictable(hits):
            return 0
        self.pool.touch(hits)  # before allocate, so that the hits are not evicted
        req.blocks = hits + self.pool.allocate(need)
        req.computed = cached
        req.num_cached_blocks = len(hits)
        self._c.cache_hit_tokens += cached
        self._admit(req)
        return n

    def _emit_and_cache(self, req: Sequence, n: int) -> ScheduledChunk:
        chunk = self._emit(req, n)
        full = (req.computed if req.steps is None else min(req.computed, req.num_own_prompt)) // (
            self.block_size
        )
        hashes = req.block_hashes(full, self.block_size)
        for i in range(req.num_cached_blocks, full):
            self.pool.cache(req.blocks[i], hashes[i])
        req.num_cached_blocks = full
        return chunk
