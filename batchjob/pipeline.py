"""One job end to end: read -> tokenize -> plan -> execute -> write results and report.

``run(job)`` is the Python API under ``batchjob run``. Results stream to atomic part files
as requests finish; a rerun of an interrupted job skips the rows already written.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from batchjob.backends import open_backend
from batchjob.backends.base import FinishedRequest
from batchjob.config import JobConfig
from batchjob.io import STATUS_OK
from batchjob.plan.build import build_plan
from batchjob.plan.plan_io import write_plan
from batchjob.prompts import TokenizedPrompts
from batchjob.report import RunSummary, summarize, write_report
from batchjob.results import ResultRow, ResultSink, output_file
from batchjob.tokenize import detokenize, load_prompts, load_tokenizer


@dataclass(frozen=True)
class JobResult:
    results_path: Path
    report_paths: dict[str, Path]
    summary: RunSummary | None  # None when the job was already complete


def _remove_results(path: Path) -> None:
    """Delete earlier results of this job (output.overwrite): the file or our files in the dir."""
    if path.suffix == ".parquet":
        path.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(path.name + ".parts"), ignore_errors=True)
        return
    for f in path.glob("results-*.parquet"):
        f.unlink()
    (path / "_SUCCESS").unlink(missing_ok=True)
    shutil.rmtree(path / "_parts", ignore_errors=True)


def select_rows(prompts: TokenizedPrompts, keep: np.ndarray) -> TokenizedPrompts:
    """The prompts whose ``keep`` flag is set (bool [N]), tokens compacted."""
    lengths = prompts.lengths[keep]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    token_mask = np.repeat(keep, prompts.lengths)
    return TokenizedPrompts(
        row_ids=prompts.row_ids[keep],
        tokens=prompts.tokens[token_mask],
        offsets=offsets,
        max_tokens=prompts.max_tokens[keep],
    )


def run(job: JobConfig, progress: bool = True) -> JobResult:
    """Run ``job``; returns where results and report went and the summary."""
    t_job = time.perf_counter()
    done_marker = output_file(job.output.path)
    if job.output.overwrite:
        _remove_results(Path(job.output.path))
    elif done_marker.exists():
        return JobResult(done_marker, {}, None)  # complete already: idempotent for schedulers
    stage: dict[str, float] = {}

    loaded, _ = load_prompts(job)
    stage["read_s"], stage["tokenize_s"] = loaded.read.seconds, loaded.tokenize.seconds
    sink = ResultSink(
        job.output.path, flush_rows=job.output.flush_rows, rows_per_file=job.output.rows_per_file
    )
    done = sink.done_row_ids()
    prompts = select_rows(loaded.prompts, ~np.isin(loaded.prompts.row_ids, done))
    rejected = loaded.rejected
    for i in np.flatnonzero(~np.isin(rejected.row_ids, done)):
        sink.add(
            ResultRow(
                int(rejected.row_ids[i]),
                None,
                None,
                0,
                0,
                None,
                rejected.status[i],
                rejected.message[i],
            )
        )

    t0 = time.perf_counter()
    plan = build_plan(prompts, enlarge=job.scheduler.enlarge, order=job.scheduler.reorder)
    write_plan(plan, job.output.plan_file)
    stage["plan_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(job.model.path)
    backend = open_backend(job, lambda ids: detokenize(tokenizer, [ids])[0])
    backend.check_fits(prompts, plan)
    stage["load_s"] = time.perf_counter() - t0

    lengths = prompts.lengths
    generated = 0
    bar = tqdm(total=len(prompts), unit="row", disable=not progress, desc="batchjob")

    def on_finish(o: FinishedRequest) -> None:
        nonlocal generated
        generated += len(o.token_ids)
        text = o.text if o.text is not None else detokenize(tokenizer, [o.token_ids])[0]
        sink.add(
            ResultRow(
                o.row_id,
                text,
                o.token_ids,
                int(lengths[o.position]),
                len(o.token_ids),
                o.finish_reason,
                STATUS_OK,
                None,
            )
        )
        bar.update(1)

    t_run = time.perf_counter()

    def on_iteration(_rec) -> None:
        if progress and _rec.iteration % 8 == 0:
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - t_run, 1e-9):.0f}")

    try:
        run_info = backend.run(prompts, plan, on_finish, on_iteration=on_iteration)
    finally:
        bar.close()
        backend.close()
        sink.flush()  # whatever finished is on disk, even on Ctrl-C or a crash
    stage["run_s"] = run_info.wall_s

    t0 = time.perf_counter()
    results_path = sink.finalize(loaded.passthrough, expected_rows=loaded.num_rows)
    stage["write_s"] = time.perf_counter() - t0
    summary = summarize(
        run_info,
        prompt_tokens=int(lengths.sum()),
        generated_tokens=generated,
        requests_run=len(prompts),
        rows={
            "total": loaded.num_rows,
            "ok": len(loaded.prompts),
            "rejected": len(loaded.rejected),
            "skipped": len(done),
        },
        plan_ratios=(plan.stats.saving_ratio_single_level, plan.stats.saving_ratio_multi_level),
        total_s=time.perf_counter() - t_job,
        stage_s=stage,
        policy=job.scheduler.policy,
        device=backend.device,
        results=results_path,
    )
    paths = write_report(summary, run_info, job.output.report_file)
    return JobResult(results_path, paths, summary)
