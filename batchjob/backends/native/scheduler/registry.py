"""Scheduling policies by name: one list used by config validation, errors and dispatch."""

from __future__ import annotations

from batchjob.backends.names import SCHEDULING_POLICIES
from batchjob.backends.native.kv_cache import KVLayout
from batchjob.backends.native.scheduler.base import LabelSteps, Scheduler
from batchjob.backends.native.scheduler.baseline import BaselineScheduler
from batchjob.backends.native.scheduler.batchllm import BatchLLMScheduler
from batchjob.config import SchedulerConfig
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts


def make_scheduler(
    cfg: SchedulerConfig,
    kv: KVLayout,
    prompts: TokenizedPrompts,
    plan: Plan | None,
    label_steps: LabelSteps | None = None,
) -> Scheduler:
    """The scheduler of ``cfg.policy``. batchllm without a plan: groups of one, file order.
    ``label_steps``: scoring mode, each request's teacher-forced label steps."""
    if cfg.policy == "batchllm":
        return BatchLLMScheduler(cfg, kv, prompts, plan, label_steps)
    if cfg.policy == "baseline":
        return BaselineScheduler(cfg, kv, prompts, label_steps)
    # unreachable for a loaded config: SchedulerConfig checks the name against the same list
    raise ValueError(
        f"unknown scheduling policy {cfg.policy!r} (use {', '.join(SCHEDULING_POLICIES)})"
    )
