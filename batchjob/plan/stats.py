"""Plan statistics: Eq. 2 saving ratios, size distributions, KV footprint of the largest group.

Eq. 2: R = 1 - processed_prefill_tokens / logical_prefill_tokens, with
- multi-level: processed = tokens of the compact prefix tree of the full prompts (each
  distinct prefix computed once: a perfect multi-level prefix cache). This ignores the plan
  invariant (a prompt identical to, or a prefix of, another still needs one token of its
  own), so it is an upper bound;
- single-level (this plan): processed = sum over groups of prefix_len + sum of every
  member's distinct length (its length minus its group's prefix_len); a row's further samples
  (``sampling.n``) count one token each (they copy the rest from the first).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from batchjob.plan.plan import Plan, PlanStats
from batchjob.tokenize.prompts import TokenizedPrompts


def _ratio(processed: int, logical: int) -> float:
    return 1.0 - processed / logical if logical else 0.0


def plan_stats(
    lengths: np.ndarray,
    group_prefix_len: np.ndarray,
    group_offsets: np.ndarray,
    multi_level_tokens: int,
    sibling_saving: int = 0,
) -> PlanStats:
    """PlanStats of a grouping; lengths by prompt position. ``sibling_saving``: own prompt
    tokens the samples of a row copy from its first sample instead of computing."""
    logical = int(lengths.sum())
    sizes = np.diff(group_offsets)
    single = logical - int(((sizes - 1) * group_prefix_len).sum()) - sibling_saving
    return PlanStats(
        num_requests=len(lengths),
        num_groups=len(group_prefix_len),
        logical_prefill_tokens=logical,
        single_level_prefill_tokens=single,
        multi_level_prefill_tokens=int(multi_level_tokens),
        saving_ratio_single_level=_ratio(single, logical),
        saving_ratio_multi_level=_ratio(int(multi_level_tokens), logical),
    )


def _dist(x: np.ndarray) -> dict[str, float]:
    """mean, p50, p90, p99, max of x (zeros when empty)."""
    if len(x) == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {
        "mean": float(x.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(x.max()),
    }


@dataclass(frozen=True)
class PlanSummary:
    """What `batchjob plan` prints: sizes and distributions of a plan."""

    num_requests: int
    num_groups: int
    num_shared_groups: int  # groups with >= 2 members
    requests_in_shared_groups: int
    share_degree_histogram: dict[int, int]  # members per group -> number of groups
    share_degree: dict[str, float]  # members per shared group: mean/p50/p90/p99/max
    prefix_len: dict[str, float]  # prefix tokens per shared group
    distinct_len: dict[str, float]  # distinct tokens per request
    decode_estimate: dict[str, float]  # decode estimate per request
    saving_ratio_single_level: float
    saving_ratio_multi_level: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["share_degree_histogram"] = {str(k): v for k, v in self.share_degree_histogram.items()}
        return d


def group_distinct_lengths(plan: Plan, prompts: TokenizedPrompts) -> np.ndarray:
    """int64 [N]: distinct tokens of each entry of ``plan.members``."""
    prefix = np.repeat(plan.group_prefix_len, np.diff(plan.group_offsets))
    return prompts.lengths[plan.members] - prefix


def summarize_plan(plan: Plan, prompts: TokenizedPrompts) -> PlanSummary:
    sizes = np.diff(plan.group_offsets)
    shared = sizes >= 2
    degrees, counts = np.unique(sizes, return_counts=True)
    return PlanSummary(
        num_requests=len(plan.members),
        num_groups=plan.num_groups,
        num_shared_groups=int(shared.sum()),
        requests_in_shared_groups=int(sizes[shared].sum()),
        share_degree_histogram={int(k): int(c) for k, c in zip(degrees, counts, strict=True)},
        share_degree=_dist(sizes[shared]),
        prefix_len=_dist(plan.group_prefix_len[shared]),
        distinct_len=_dist(group_distinct_lengths(plan, prompts)),
        decode_estimate=_dist(plan.decode_estimate),
        saving_ratio_single_level=plan.stats.saving_ratio_single_level,
        saving_ratio_multi_level=plan.stats.saving_ratio_multi_level,
    )


def group_kv_tokens(plan: Plan, prompts: TokenizedPrompts) -> np.ndarray:
    """int64 [G]: KV tokens a group holds at its peak (prefix once, every member's distinct
    tokens and decode estimate)."""
    own = group_distinct_lengths(plan, prompts) + plan.decode_estimate
    seg = np.repeat(np.arange(plan.num_groups), np.diff(plan.group_offsets))
    per_group = np.bincount(seg, weights=own, minlength=plan.num_groups).astype(np.int64)
    return plan.group_prefix_len + per_group


def largest_group_kv_bytes(
    plan: Plan, prompts: TokenizedPrompts, bytes_per_token: int
) -> tuple[int, int]:
    """(group index, estimated KV bytes) of the group with the largest KV footprint.

    bytes_per_token: KV bytes per token for the model (2 * layers * kv_heads * head_dim *
    dtype bytes). Returns (-1, 0) for an empty plan.
    """
    if plan.num_groups == 0:
        return -1, 0
    tokens = group_kv_tokens(plan, prompts)
    g = int(np.argmax(tokens))
    return g, int(tokens[g]) * int(bytes_per_token)
