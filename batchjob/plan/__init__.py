"""Global prefix planner: prompts -> prefix tree -> groups (Algo 1) -> Eq. 4 order -> Plan."""

from __future__ import annotations

from batchjob.plan.build import build_plan, plan_job
from batchjob.plan.plan import Plan, PlanStats
from batchjob.plan.plan_io import read_plan, write_plan
from batchjob.plan.prefix_tree import PrefixTree, build_prefix_tree
from batchjob.plan.reuse import Grouping, first_level_groups, optimal_groups, paper_groups
from batchjob.plan.seqsort import SortedSequences, sort_sequences
from batchjob.plan.stats import (
    PlanSummary,
    group_kv_tokens,
    largest_group_kv_bytes,
    plan_stats,
    summarize_plan,
)

__all__ = [
    "Grouping",
    "Plan",
    "PlanStats",
    "PlanSummary",
    "PrefixTree",
    "SortedSequences",
    "build_plan",
    "build_prefix_tree",
    "first_level_groups",
    "group_kv_tokens",
    "largest_group_kv_bytes",
    "optimal_groups",
    "paper_groups",
    "plan_job",
    "plan_stats",
    "read_plan",
    "sort_sequences",
    "summarize_plan",
    "write_plan",
]
