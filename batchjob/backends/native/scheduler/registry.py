"""Scheduling policies by name: one list used by config validation, errors and dispatch."""

from __future__ import annotations

from batchjob.backends.names import SCHEDULING_POLICIES
from batchjob.backends.native.scheduler.base import Scheduler, SchedulerSettings
from batchjob.backends.native.scheduler.baseline import BaselineScheduler
from batchjob.backends.native.scheduler.batchllm import BatchLLMScheduler
from batchjob.plan.plan import Plan
from batchjob.prompts import TokenizedPrompts


def make_scheduler(
    settings: SchedulerSettings, prompts: TokenizedPrompts, plan: Plan | None
) -> Scheduler:
    """The scheduler of ``settings.policy``. batchllm without a plan: groups of one, file order."""
    if settings.policy == "batchllm":
        return BatchLLMScheduler(settings, prompts, plan)
    if settings.policy == "baseline":
        return BaselineScheduler(settings, prompts)
    raise ValueError(
        f"unknown scheduling policy {settings.policy!r} (use {', '.join(SCHEDULING_POLICIES)})"
    )
