"""Run report: per-iteration Parquet, a JSON summary, and the tokens-per-iteration plot.

TECD (time excluding cool-down, BatchLLM 6.3.2): wall time up to the end of the last
iteration that still carried prefill tokens. After it only decodes of the last requests
remain (the cool-down), whose length does not grow with the dataset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from batchjob.backends.base import BackendRun, IterationRecord
from batchjob.config import ModelConfig
from batchjob.storage.atomic import save_figure_atomic, write_json_atomic, write_parquet_atomic
from batchjob.storage.stores import ObjectPath, store_for

if TYPE_CHECKING:
    from batchjob.outputs.spilled_records import IterationLog


@dataclass(frozen=True)
class RunSummary:
    """Headline numbers of one job run."""

    rows_total: int  # result rows: one per sample of each row, one per rejected row
    rows_ok: int
    rows_rejected: int
    rows_skipped_done: int  # finished by an earlier run of the same job (resume)
    requests_run: int
    prompt_tokens: int  # logical prompt tokens of the requests run
    generated_tokens: int
    computed_prefill_tokens: int  # prefill tokens the engine computed (recompute included)
    recomputed_tokens: int  # tokens computed again after preemption
    saving_ratio_planned: float  # Eq. 2 of the plan (single level)
    saving_ratio_multi_level: float  # Eq. 2 optimum of the full prefix tree
    saving_ratio_achieved: float  # 1 - (computed - recomputed) / prompt tokens
    iterations: int
    mean_tokens_per_iteration: float
    min_tokens_per_iteration: int
    preemptions: int
    peak_kv_bytes: int
    kv_budget_bytes: int
    engine_s: float  # engine wall time
    tecd_s: float  # time excluding cool-down
    total_s: float  # whole job: read, tokenize, plan, load, run, write
    stage_s: dict[str, float]
    requests_per_s: float  # over engine time
    prompt_tokens_per_s: float
    generated_tokens_per_s: float
    policy: str
    device: str
    # result rows per "status/finish_reason" ("ok/stop", "ok/length", "empty_prompt/-", ...),
    # counted over the final results, rows of earlier runs included
    outcomes: dict[str, int] = field(default_factory=dict)
    # which job: input/model paths, job file, config, batchjob version, started/finished (UTC)
    job: dict = field(default_factory=dict)
    input_rows: int = 0  # the input rows those results are of (rows_total with sampling.n 1)
    task: str = ModelConfig.task  # model.task; embed: requests_per_s is rows embedded per second


def outcome_counts(results: Path | ObjectPath) -> dict[str, int]:
    """Rows per (status, finish_reason) of a results file or folder of Parquet parts.

    A polars lazy scan reads only the two columns and groups without building Python rows
    (on an object store the two columns are read through its filesystem).
    """
    import polars as pl

    from batchjob.outputs.ownership import committed_files  # the commit's files, no other

    if isinstance(results, Path):
        files = committed_files(results)
        scan = pl.scan_parquet(files) if files else None
    else:
        store, cols = store_for(results), ["status", "finish_reason"]
        found = committed_files(results)
        tables = [store.read_parquet(f, columns=cols) for f in found]
        scan = pl.LazyFrame(pa.concat_tables(tables)) if tables else None
    if scan is None:
        return {}
    counts = (
        scan.group_by("status", "finish_reason")
        .len()
        .sort("status", "finish_reason", nulls_last=True)
        .collect()
    )
    return {f"{st}/{fr or '-'}": n for st, fr, n in counts.iter_rows()}


def tecd_seconds(records: list[IterationRecord]) -> float:
    last = max((r.iteration for r in records if r.prefill_tokens > 0), default=-1)
    return float(sum(r.wall_s for r in records if r.iteration <= last))


def iterations_table(records: list[IterationRecord]) -> pa.Table:
    cols = [f.name for f in dataclasses.fields(IterationRecord)]
    return pa.table({c: [getattr(r, c) for r in records] for c in cols})


def summarize(
    run: BackendRun,
    *,
    prompt_tokens: int,
    generated_tokens: int,
    requests_run: int,
    rows: dict[str, int],
    plan_ratios: tuple[float, float],
    total_s: float,
    stage_s: dict[str, float],
    policy: str,
    device: str,
    results: Path | ObjectPath | None = None,
    iterations: IterationLog | None = None,
) -> RunSummary:
    """``iterations``: the run's records spilled as they came (a partitioned run; its
    ``run.iterations`` is then empty), else ``run.iterations``."""
    if iterations is not None:
        n_it, mean_it = iterations.count, iterations.mean_tokens
        min_it, tecd = iterations.min_tokens, iterations.tecd_s
    else:
        tokens = np.array(
            [r.decode_tokens + r.prefill_tokens for r in run.iterations], dtype=np.int64
        )
        n_it = len(tokens)
        mean_it = float(tokens.mean()) if len(tokens) else 0.0
        min_it = int(tokens.min()) if len(tokens) else 0
        tecd = tecd_seconds(run.iterations)
    computed = run.computed_prefill_tokens
    first_time = computed - run.recomputed_tokens
    engine_s = max(run.wall_s, 1e-9)
    return RunSummary(
        rows_total=rows["total"],
        rows_ok=rows["ok"],
        rows_rejected=rows["rejected"],
        rows_skipped_done=rows["skipped"],
        input_rows=rows.get("input", rows["total"]),
        requests_run=requests_run,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
        computed_prefill_tokens=computed,
        recomputed_tokens=run.recomputed_tokens,
        saving_ratio_planned=plan_ratios[0],
        saving_ratio_multi_level=plan_ratios[1],
        saving_ratio_achieved=1.0 - first_time / prompt_tokens if prompt_tokens else 0.0,
        iterations=n_it,
        mean_tokens_per_iteration=mean_it,
        min_tokens_per_iteration=min_it,
        preemptions=run.preemptions,
        peak_kv_bytes=run.peak_kv_bytes,
        kv_budget_bytes=run.kv_budget_bytes,
        engine_s=run.wall_s,
        tecd_s=tecd,
        total_s=total_s,
        stage_s=stage_s,
        requests_per_s=requests_run / engine_s,
        prompt_tokens_per_s=prompt_tokens / engine_s,
        generated_tokens_per_s=generated_tokens / engine_s,
        policy=policy,
        device=device,
        outcomes=outcome_counts(results) if results is not None else {},
    )


def plot_timeline(records: list[IterationRecord], path: Path | ObjectPath, title: str) -> None:
    """Tokens per iteration, decode and prefill stacked (the paper's Figures 2 and 6)."""
    it = np.array([r.iteration for r in records])
    dec = np.array([r.decode_tokens for r in records])
    pre = np.array([r.prefill_tokens for r in records])
    _plot(it, dec, pre, path, title)


def _plot(
    it: np.ndarray, dec: np.ndarray, pre: np.ndarray, path: Path | ObjectPath, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.bar(it, dec, width=1.0, color="#1f77b4", label="decode tokens")
    ax.bar(it, pre, width=1.0, bottom=dec, color="#ff7f0e", label="prefill tokens")
    ax.set_xlabel("iteration")
    ax.set_ylabel("tokens in batch")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path, format="png", dpi=110)
    finally:
        plt.close(fig)


def write_report(
    summary: RunSummary,
    run: BackendRun,
    report_json: Path | ObjectPath,
    iterations: IterationLog | None = None,
) -> dict[str, Path | ObjectPath]:
    """Write summary JSON, iterations Parquet and the PNG next to it; returns the paths.
    ``iterations``: as ``summarize``'s (copied a row group at a time)."""
    base = report_json.with_suffix("")
    paths = {
        "json": report_json,
        "iterations": base.with_name(base.name + ".iterations.parquet"),
        "timeline": base.with_name(base.name + ".timeline.png"),
    }
    if iterations is not None:
        iterations.write(paths["iterations"])
    else:
        write_parquet_atomic(iterations_table(run.iterations), paths["iterations"])
    write_parquet_atomic(
        pa.table(
            {k: [v] for k, v in dataclasses.asdict(summary).items() if not isinstance(v, dict)}
        ),
        base.with_name(base.name + ".summary.parquet"),
    )
    paths["summary"] = base.with_name(base.name + ".summary.parquet")
    write_json_atomic(dataclasses.asdict(summary), report_json)
    title = f"{summary.policy}: tokens per iteration"
    if iterations is not None and iterations.count:
        c = iterations.columns(["iteration", "decode_tokens", "prefill_tokens"])
        _plot(c["iteration"], c["decode_tokens"], c["prefill_tokens"], paths["timeline"], title)
    elif run.iterations:
        plot_timeline(run.iterations, paths["timeline"], title)
    return paths
