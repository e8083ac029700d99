"""How much memory planning takes, and the budget it must fit (``scheduler.plan_memory``).

``plan_bytes`` is the in-memory planner's peak for a dataset's size: the prompts' arrays
(int32 tokens; row id, offset and max_tokens per row) and the planner's own arrays (sort
order and LCPs, tree, groups, plan), fitted on the bench_scale shape (50 tokens a row: 244
bytes a row above the input) and natural-qa (460 tokens a row: 1,067). A dataset whose
estimate exceeds the budget is planned in partitions (``batchjob.plan.streamed``), each
sized to half the budget, so that a partition the key split unevenly still fits.
"""

from __future__ import annotations

import os

BYTES_PER_ROW = 280  # row id, offset, max_tokens (20) + the planner's per-row arrays
BYTES_PER_TOKEN = 6  # the int32 token + the planner's per-token work (sort windows, LCPs)
FILL = 0.5  # a partition's target share of the budget


def plan_bytes(rows: int | float, tokens: int | float) -> int:
    """Estimated peak bytes of planning ``rows`` prompts of ``tokens`` tokens in memory."""
    return int(BYTES_PER_ROW * rows + BYTES_PER_TOKEN * tokens)


def default_budget() -> int:
    """``scheduler.plan_memory`` unset: half of the machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(total) // 2


def budget_of(plan_memory: int | None) -> int:
    return int(plan_memory) if plan_memory is not None else default_budget()


def num_partitions(rows: int, tokens: int, budget: int) -> int:
    """Partitions of the first split: each estimated at ``FILL`` of the budget, at least 2."""
    target = max(int(budget * FILL), 1)
    return max(2, min(1 << 16, -(-plan_bytes(rows, tokens) // target)))
