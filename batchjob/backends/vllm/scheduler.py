"""Schedulers for vLLM's v1 engine, plugged in through its own ``scheduler_cls`` setting.

Subclasses of vLLM's ``Scheduler`` (no fork, no monkey-patching) that override four narrow
methods and leave vLLM's scheduling loop, KV manager and prefix cache as they are:

- ``RecordingScheduler`` (policy ``baseline``): vLLM's own policy, plus one
  ``IterationRecord`` per step (decode/prefill tokens, sequences, KV blocks in use,
  preemptions, wall time) and the count of prefill tokens computed.
- ``BatchLLMScheduler`` (policy ``batchllm``), the BatchLLM method on top of plan order
  (requests arrive group by group, Eq. 4 order):

  * decode first: running requests in decode go before unfinished prefills each step; the
    waiting queue is in plan order, so the distinct prompts of a started group come before
    the next group's first member, which carries the next prefix (Algorithm 2's order).
  * the common prefix once: vLLM caches a block when it is allocated, so the members
    admitted after their group's first member hit the prefix blocks it computes; the
    scheduler then pins those blocks (one extra reference) until the group's last member
    finishes, so LRU eviction or preemption never drops a prefix that members still need.
  * admission by KV memory, not by request count: before each step the admission limit
    (``max_num_active_reqs``) is set to the running requests plus the most waiting requests,
    in queue order, that keep the projected KV peak under ``kv_threshold`` of the cache: every
    request grows by one block per ``block_size`` decode steps for its projected remaining
    tokens and frees its own blocks when it finishes (``projected_peak_blocks``): a
    decode-growth reserve that does not assume all requests reach their maximum length at
    once. Remaining tokens are learned from the finished requests' output lengths
    (``decode_lengths``; ``max_tokens`` until stops are seen).

Group membership travels with each request in ``SamplingParams.extra_args["batchjob"]``:
``[group key, prefix_len, group size]``. Records are read in-process by the backend (the
engine core runs in the calling process).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from batchjob.backends.base import IterationRecord
from batchjob.backends.decode_lengths import DecodeLengths
from batchjob.backends.kv_projection import prefix_peaks
from batchjob.config.sections import KV_THRESHOLD_VLLM
from batchjob.plan.intmath import cdiv

EXTRA_KEY = "batchjob"  # SamplingParams.extra_args key


def group_info(request) -> tuple[str, int, int] | None:
    """(group key, prefix_len, group size) of a request submitted by the backend."""
    extra = request.sampling_params.extra_args if request.sampling_params else None
    info = extra.get(EXTRA_KEY) if extra else None
    return None if info is None else (str(info[0]), int(info[1]), int(info[2]))


@dataclass
class StepCounters:
    """Totals over the engine's life; the backend takes differences per run."""

    steps: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    records: list[IterationRecord] = field(default_factory=list)


if TYPE_CHECKING:  # the mixins are only ever mixed into vLLM's Scheduler (classes below)
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class _RecordingMixin(_SchedulerBase):
    """One ``IterationRecord`` per step with scheduled tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # vLLM's Scheduler: the next class in the MRO
        self._bj_setup()

    def _bj_setup(self) -> None:
        self.bj = StepCounters()
        self._bj_t0 = 0.0
        # steps scheduled, not yet processed (FIFO: async scheduling keeps two in flight)
        self._bj_pending: deque[tuple[float, int, int, int, int]] = deque()

    def bj_new_run(self) -> None:
        """A new run (another dataset) starts: what a policy learns per run is reset."""

    def bj_blocks_in_use(self) -> int:
        pool = self.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # minus the null block

    def schedule(self, *args, **kwargs):
        self._bj_t0 = time.perf_counter()
        return super().schedule(*args, **kwargs)

    def _update_after_schedule(self, scheduler_output) -> None:
        # before super(): num_computed_tokens is still the count before this step
        decode = prefill = 0
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            r = self.requests[req_id]
            if r.num_computed_tokens >= max(r.num_prompt_tokens, r.num_tokens - 1):
                decode += n
            else:
                prefill += n  # prompt chunks and recomputation after a preemption
        preempted = len(scheduler_output.preempted_req_ids)
        seqs = len(scheduler_output.num_scheduled_tokens)
        self._bj_pending.append((self._bj_t0, decode, prefill, seqs, preempted))
        super()._update_after_schedule(scheduler_output)

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        pending = self._bj_pending.popleft() if self._bj_pending else None
        if pending is not None and scheduler_output.total_num_scheduled_tokens > 0:
            t0, decode, prefill, seqs, preempted = pending
            used = self.bj_blocks_in_use()
            c = self.bj
            c.prefill_tokens += prefill
            c.preemptions += preempted
            c.peak_blocks = max(c.peak_blocks, used)
            c.records.append(
                IterationRecord(
                    iteration=c.steps,
                    decode_tokens=decode,
                    prefill_tokens=prefill,
                    num_seqs=seqs,
                    kv_blocks_used=used,
                    kv_bytes_used=0,  # the backend fills bytes (it knows the block size)
                    preempted=preempted,
                    wall_s=time.perf_counter() - t0,
                )
            )
            c.steps += 1
        return out


class _Group:
    __slots__ = ("closed", "key", "pinned", "prefix_blocks", "unfinished")

    def __init__(self, key: str, prefix_blocks: int, size: int) -> None:
        self.key = key
        self.prefix_blocks = prefix_blocks  # full blocks of the shared prefix
        self.unfinished = size
        self.pinned: list | None = None  # prefix blocks held by the group
        self.closed = False  # its last member finished: its prefix blocks went back


class _BatchLLMMixin(_RecordingMixin):
    def _bj_setup(self) -> None:
        super()._bj_setup()
        self.bj_kv_threshold = KV_THRESHOLD_VLLM  # kv_threshold_for("vllm"), set by the backend
        self._bj_groups: dict[str, _Group] = {}
        self._bj_req_groups: dict[str, _Group | None] = {}  # request id -> its group
        self._bj_lengths = DecodeLengths()  # finished requests' output lengths (the reserve)

    def bj_new_run(self) -> None:
        """A new run (another dataset): its decode lengths are learned afresh."""
        self._bj_lengths = DecodeLengths()

    # --- group bookkeeping ------------------------------------------------------------
    def add_request(self, request) -> None:
        super().add_request(request)
        self._bj_remember(request)

    def _bj_remember(self, request) -> None:
        """Its group (made by its first member), kept by request id: admission looks up the
        group of every running and waiting request each step."""
        info = group_info(request)
        if info is not None and info[0] not in self._bj_groups:
            key, prefix_len, size = info
            self._bj_groups[key] = _Group(key, prefix_len // self.block_size, size)
        group = None if info is None else self._bj_groups[info[0]]
        self._bj_req_groups[request.request_id] = group

    def _bj_group(self, request) -> _Group | None:
        g = self._bj_req_groups.get(request.request_id)
        return None if g is None or g.closed else g

    def _free_request(self, request, *args, **kwargs):
        out = super()._free_request(request, *args, **kwargs)
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            capped = request.status == RequestStatus.FINISHED_LENGTH_CAPPED
            self._bj_lengths.finished(request.num_output_tokens, capped)
        g = self._bj_req_groups.pop(request.request_id, None)
        if g is not None and not g.closed:
            g.unfinished -= 1
            if g.unfinished <= 0:  # the group's last member: its prefix may go now
                if g.pinned:
                    self.kv_cache_manager.block_pool.free_blocks(reversed(g.pinned))
                g.closed = True
                del self._bj_groups[g.key]
        return out

    def _update_after_schedule(self, scheduler_output) -> None:
        super()._update_after_schedule(scheduler_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            r = self.requests[req_id]
            g = self._bj_group(r)
            if g is None or g.pinned is not None or g.prefix_blocks == 0 or g.unfinished < 2:
                continue
            if r.num_computed_tokens < g.prefix_blocks * self.block_size:
                continue  # the prefix is still being computed (chunked prefill)
            blocks = self.kv_cache_manager.get_blocks(req_id).blocks
            if len(blocks) != 1:  # hybrid models (several KV groups): no pinning
                g.pinned = []
                continue
            g.pinned = list(blocks[0][: g.prefix_blocks])
            self.kv_cache_manager.block_pool.touch(g.pinned)

    # --- admission and order ----------------------------------------------------------
    def schedule(self, *args, **kwargs):
        if any(r.is_prefill_chunk for r in self.running):
            self.running.sort(key=lambda r: r.is_prefill_chunk)  # stable: decodes first
        self.max_num_active_reqs = self._bj_admission_limit()
        return super().schedule(*args, **kwargs)

    def _bj_first_waiting_blocked(self, used: int, cap: int) -> bool:
        """Whether the first waiting request cannot fit on top of the blocks in use (its
        blocks past its group's prefix): then the pass below stops at it and admits nothing
        more, so a KV-full step skips that pass over every running request. Exact: the pass's
        floor is at least the blocks in use, and its share of the first request at least this."""
        first = next(iter(self.waiting))
        g = self._bj_group(first)
        own = cdiv(first.num_tokens, self.block_size) - (g.prefix_blocks if g is not None else 0)
        return used + max(own, 0) > cap

    def _bj_admission_limit(self) -> int:
        """Running requests + the most waiting ones (in order) whose admission keeps the
        projected KV peak under the threshold (``projected_peak_blocks``)."""
        bs = self.block_size
        total = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        cap = int(self.bj_kv_threshold * total)
        room = self.max_num_running_reqs - len(self.running)
        if room <= 0 or not self.waiting:
            return max(1, len(self.running))
        used = self.bj_blocks_in_use()
        if self._bj_first_waiting_blocked(used, cap):
            return max(1, len(self.running))
        # what runs: tokens now, decode steps left, own blocks (a pinned prefix stays held)
        run = self.running
        n = len(run)
        groups = [self._bj_group(r) for r in run]

        def column(values) -> np.ndarray:
            return np.fromiter(values, np.int64, n)

        computed = column(r.num_computed_tokens for r in run)
        outs = column(r.num_output_tokens for r in run)
        pinned = column(g.prefix_blocks if g is not None and g.pinned else 0 for g in groups)
        run_tok = np.maximum(computed, column(r.num_tokens for r in run))  # a prefill ends whole
        # decode tokens still to come: learned from finished requests (decode_lengths)
        est = self._bj_lengths.table(outs)
        run_rem = est.remaining_array(outs, column(r.max_tokens for r in run))
        held = int(np.maximum(cdiv(computed, bs) - pinned, 0).sum())
        base = used - held  # blocks no running request frees
        # the peak is at least every request's blocks now: candidates past the one that
        # breaks that bound cannot fit, so they are not projected at all
        floor = base + int(np.maximum(cdiv(run_tok, bs) - pinned, 0).sum())
        # groups whose prefix blocks are held: a waiting member needs its own part only
        started = {id(g) for g in self._bj_groups.values() if g.pinned}
        started |= {id(g) for g in groups if g is not None}
        tok: list[int] = []
        outs_w: list[int] = []
        limits_w: list[int] = []
        shared: list[int] = []
        for r in self.waiting:
            if len(tok) >= min(room, 256):
                break
            g = self._bj_group(r)
            held_prefix = g.prefix_blocks if g is not None and id(g) in started else 0
            floor += max(cdiv(r.num_tokens, bs) - held_prefix, 0)
            if floor > cap:
                break
            tok.append(r.num_tokens)  # its prompt (+ outputs, if preempted) within a step
            outs_w.append(r.num_output_tokens)
            limits_w.append(r.max_tokens)
            shared.append(held_prefix)
            if g is not None:
                started.add(id(g))
        wait_rem = est.remaining_array(np.asarray(outs_w, np.int64), np.asarray(limits_w, np.int64))
        # the peak with the running requests and the first k candidates, for every k at
        # once (nondecreasing): the largest k that keeps it under the cap
        peaks = prefix_peaks(
            np.concatenate([run_tok, np.asarray(tok, np.int64)]),
            np.concatenate([run_rem, wait_rem]),
            np.concatenate([pinned, np.asarray(shared, np.int64)]),
            bs,
        )[n:]
        lo = int(np.searchsorted(peaks, cap - base, side="right"))
        admitted = lo if self.running else max(lo, 1)  # progress: vLLM refuses what cannot fit
        return max(1, min(n + admitted, self.max_num_running_reqs))


class RecordingScheduler(_RecordingMixin, Scheduler):
    """vLLM's own scheduler, recording each step."""


class RecordingAsyncScheduler(_RecordingMixin, AsyncScheduler):
    """The same with vLLM's async scheduling."""


class BatchLLMScheduler(_BatchLLMMixin, Scheduler):
    """The BatchLLM policy inside vLLM (see the module docstring)."""


class BatchLLMAsyncScheduler(_BatchLLMMixin, AsyncScheduler):
    """The same with vLLM's async scheduling."""


def scheduler_class_path(policy: str, async_scheduling: bool) -> str:
    """The ``scheduler_cls`` string for a batchjob policy."""
    name = {"batchllm": "BatchLLMScheduler", "baseline": "RecordingScheduler"}[policy]
    if async_scheduling:
        name = name.replace("Scheduler", "AsyncScheduler")
    return f"{__name__}.{name}"
