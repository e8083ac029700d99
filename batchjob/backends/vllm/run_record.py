"""One run's share of the recording scheduler's lifetime counters.

The engine (and its ``StepCounters``) outlives a run; a run takes the differences from its
start, renumbers its iteration records from its own first step and gives each its KV bytes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from batchjob.backends.base import BackendRun, IterationRecord, OnIteration

if TYPE_CHECKING:  # (the scheduler module imports vLLM)
    from batchjob.backends.vllm.scheduler import StepCounters


class RunRecorder:
    """Snapshot the counters at a run's start; ``collect`` after every engine step hands the
    step's records to ``on_iteration``; ``finish`` returns the run's ``BackendRun``."""

    def __init__(
        self, counters: StepCounters, block_bytes: int, on_iteration: OnIteration | None
    ) -> None:
        self.counters, self.block_bytes, self.on_iteration = counters, block_bytes, on_iteration
        self.first_step = counters.steps
        self.first_prefill = counters.prefill_tokens
        self.first_preempt = counters.preemptions
        counters.peak_blocks = 0
        self.seen = len(counters.records)
        self.records: list[IterationRecord] = []
        self.t0 = time.perf_counter()

    def collect(self) -> None:
        for rec in self.counters.records[self.seen :]:
            rec = dataclasses.replace(
                rec,
                iteration=rec.iteration - self.first_step,
                kv_bytes_used=rec.kv_blocks_used * self.block_bytes,
            )
            self.records.append(rec)
            if self.on_iteration is not None:
                self.on_iteration(rec)
        self.seen = len(self.counters.records)

    def finish(self, first_time_tokens: int, num_blocks: int) -> BackendRun:
        """``first_time_tokens``: the prompt tokens the run had to compute once (what was
        computed beyond them was recomputed after preemptions)."""
        wall = time.perf_counter() - self.t0
        counters = self.counters
        del counters.records[:]  # the run's records are in `records` now
        computed = counters.prefill_tokens - self.first_prefill
        return BackendRun(
            iterations=self.records,
            computed_prefill_tokens=computed,
            recomputed_tokens=max(computed - first_time_tokens, 0),
            preemptions=counters.preemptions - self.first_preempt,
            peak_kv_bytes=counters.peak_blocks * self.block_bytes,
            kv_budget_bytes=num_blocks * self.block_bytes,
            wall_s=wall,
        )
