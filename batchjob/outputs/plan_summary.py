"""What `batchjob plan` prints: requests, group shapes, saving ratios, KV, stage timings.

The plan's own numbers come from the planner (``batchjob.plan.stats``); this module adds
what only the job knows (rejected rows, timings, model KV size, plan path) and formats it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from batchjob.inputs.parquet import RejectedRows
from batchjob.model.info import ModelInfo
from batchjob.outputs.spilled_records import RejectedSpill
from batchjob.plan.plan import Plan, PlanStats
from batchjob.plan.stats import PlanSummary, group_kv_tokens, summarize_plan
from batchjob.plan.streamed import StreamedPlan
from batchjob.timing import StageTiming
from batchjob.tokenize.prompts import TokenizedPrompts

SHARE_BUCKETS = (("1", 1, 1), ("2-4", 2, 4), ("5-16", 5, 16), ("17+", 17, None))


@dataclass(frozen=True)
class KvEstimate:
    bytes_per_token: int  # 2 * layers * kv_heads * head_dim * dtype bytes: as the engine's
    dtype: str  # resolved for the device, as the backend will run it
    device: str
    largest_group: int  # plan group index (execution order)
    largest_group_size: int  # its members
    largest_group_tokens: int  # prefix once + every member's distinct tokens + max_tokens
    largest_group_bytes: int


@dataclass(frozen=True)
class Partitions:
    """How a plan too large for ``scheduler.plan_memory`` was split (``batchjob.plan.streamed``)."""

    count: int  # partitions planned
    depths: tuple[int, ...]  # key depths (leading tokens) of the splits
    largest_rows: int  # rows of the largest partition
    largest_tokens: int  # its tokens
    budget: int  # scheduler.plan_memory in bytes
    over_budget: int  # partitions no key depth brought within the budget


@dataclass(frozen=True)
class PlanReport:
    requests: int  # requests planned (every sample of a row: sampling.n) + rejected rows
    ok: int  # requests planned
    rejected: dict[str, int]  # status -> rows rejected per row
    share_buckets: dict[str, int]  # "1", "2-4", "5-16", "17+" -> number of groups
    stats: PlanStats
    plan: PlanSummary  # distributions (share degree, prefix, distinct lengths)
    kv: KvEstimate | None  # None without a model config.json
    stages: tuple[StageTiming, ...]
    plan_path: str | None
    partitions: Partitions | None = None  # None: planned in memory
    embedding: str | None = None  # model.task = "embed": how rows are pooled; None: generate

    def to_dict(self) -> dict:
        """Flat JSON-able dict (for Airflow and scripts)."""
        plan = self.plan.to_dict()
        for k in ("num_requests", "saving_ratio_single_level", "saving_ratio_multi_level"):
            plan.pop(k)  # already in stats
        extra = {"partitions": dataclasses.asdict(self.partitions)} if self.partitions else {}
        return {
            "requests": self.requests,
            "ok": self.ok,
            "rejected": dict(self.rejected),
            "groups": self.stats.num_groups,
            "share_buckets": dict(self.share_buckets),
            **{k: v for k, v in dataclasses.asdict(self.stats).items() if k != "num_groups"},
            **plan,
            "kv": dataclasses.asdict(self.kv) if self.kv else None,
            "stages": [
                {**dataclasses.asdict(s), "tokens_per_s": s.tokens_per_s} for s in self.stages
            ],
            "plan_path": self.plan_path,
            "task": "generate" if self.embedding is None else "embed",
            "embedding": self.embedding,
            **extra,
        }

    def format(self) -> str:
        """Human summary, one topic per line."""
        st, p = self.stats, self.plan
        rej = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items()))
        buckets = ", ".join(f"{k}: {v}" for k, v in self.share_buckets.items())
        lines = [
            f"requests      {self.requests}  (ok {self.ok}, rejected {sum(self.rejected.values())}"
            + (f": {rej})" if rej else ")"),
            f"groups        {st.num_groups}  (groups of {buckets})",
            f"share degree  mean {p.share_degree['mean']:.2f}  max {p.share_degree['max']:.0f}"
            f"  (groups of 2+: {p.num_shared_groups}, holding {p.requests_in_shared_groups}"
            " requests)",
            f"prefix len    {_dist(p.prefix_len)}  (tokens, groups of 2+)",
            f"distinct len  {_dist(p.distinct_len)}  (tokens, per request)",
            f"saving ratio  multi-level {st.saving_ratio_multi_level:.1%}  "
            f"single-level plan {st.saving_ratio_single_level:.1%}",
            f"prefill       {st.logical_prefill_tokens} tokens logical, "
            f"{st.single_level_prefill_tokens} with this plan, "
            f"{st.multi_level_prefill_tokens} multi-level",
        ]
        if self.embedding is not None:  # prefill only: the saving is the whole job's
            lines.append(
                f"task          {self.embedding}: prefill only, "
                f"{st.single_level_prefill_tokens} of {st.logical_prefill_tokens} prompt tokens "
                "computed (each shared prefix once per group)"
            )
        if self.kv is None:
            lines.append("KV estimate   n/a (no model config.json)")
        else:
            k = self.kv
            lines.append(
                f"KV estimate   {_bytes(k.bytes_per_token)}/token ({k.dtype} on {k.device}); "
                f"largest group "
                f"#{k.largest_group}: {k.largest_group_size} requests, "
                f"{k.largest_group_tokens} tokens incl. max_tokens"
                f" = {_bytes(k.largest_group_bytes)}"
            )
        stages = []
        for s in self.stages:
            rate = f" ({_count(s.tokens_per_s)} tok/s)" if s.tokens else ""
            stages.append(f"{s.name} {s.seconds:.3f} s{rate}")
        lines.append("time          " + " | ".join(stages))
        if self.partitions:
            q = self.partitions
            lines.append(
                f"partitions    {q.count} (keys of the first {', '.join(map(str, q.depths))} "
                f"tokens; largest {q.largest_rows} rows, {q.largest_tokens} tokens; "
                f"budget {_bytes(q.budget)})"
            )
        if self.plan_path:
            lines.append(f"plan          {self.plan_path}")
        return "\n".join(lines)


def _dist(d: dict[str, float]) -> str:
    return f"mean {d['mean']:.1f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}  max {d['max']:.0f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def summarize(
    plan: Plan,
    prompts: TokenizedPrompts,
    rejected: RejectedRows,
    stages: tuple[StageTiming, ...] = (),
    model: ModelInfo | None = None,
    plan_path: str | None = None,
) -> PlanReport:
    """Report on a plan built from ``prompts`` (the ``rejected`` rows were left out).

    The KV estimate uses the job's ``model`` (its dtype resolved for its device, so the bytes
    per token are the backend's); None without a model folder.
    """
    sizes = np.diff(plan.group_offsets)  # [G] members per group
    buckets = {
        name: int(((sizes >= lo) & (sizes <= (hi or np.inf))).sum())
        for name, lo, hi in SHARE_BUCKETS
    }
    kv = None
    if model is not None and plan.num_groups:
        tokens = group_kv_tokens(plan, prompts)  # [G]
        g = int(np.argmax(tokens))
        per_token = model.kv_bytes_per_token
        kv = KvEstimate(
            bytes_per_token=per_token,
            dtype=model.dtype,
            device=model.device,
            largest_group=g,
            largest_group_size=int(sizes[g]),
            largest_group_tokens=int(tokens[g]),
            largest_group_bytes=int(tokens[g]) * per_token,
        )
    return PlanReport(
        requests=len(prompts) + len(rejected),
        ok=len(prompts),
        rejected=rejected.counts(),
        share_buckets=buckets,
        stats=plan.stats,
        plan=summarize_plan(plan, prompts),
        kv=kv,
        stages=tuple(stages),
        plan_path=plan_path,
    )


def summarize_partitioned(
    planned: StreamedPlan,
    rejected: RejectedRows | RejectedSpill,
    stages: tuple[StageTiming, ...],
    budget: int,
    model: ModelInfo | None = None,
    plan_path: str | None = None,
) -> PlanReport:
    """``summarize`` of a plan made in partitions, from its totals and histograms."""
    sizes = planned.size_counts
    buckets = {
        name: sum(c for k, c in sizes.items() if lo <= k <= (hi or k))
        for name, lo, hi in SHARE_BUCKETS
    }
    kv = None
    g, members, tokens = planned.largest_group
    if model is not None and g >= 0:
        per_token = model.kv_bytes_per_token
        kv = KvEstimate(
            per_token, model.dtype, model.device, g, members, tokens, tokens * per_token
        )
    big_rows, big_tokens = planned.largest_partition
    parts = Partitions(
        planned.partitions, planned.depths, big_rows, big_tokens, budget, planned.over_budget
    )
    return PlanReport(
        requests=planned.stats.num_requests + len(rejected),
        ok=planned.stats.num_requests,
        rejected=rejected.counts(),
        share_buckets=buckets,
        stats=planned.stats,
        plan=planned.summary,
        kv=kv,
        stages=tuple(stages),
        plan_path=plan_path,
        partitions=parts,
    )
