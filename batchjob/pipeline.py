"""One job end to end: read -> tokenize -> plan -> execute -> write results and report.

``run(job)`` is the Python API under ``batchjob run``. Before any work it checks the output
path, takes the output's lock and compares the job's manifest with what the output holds
(``manifest``): a rerun of the same interrupted job skips the rows already written; another
job's results or parts are refused unless ``output.overwrite``, and even then replaced only at
commit, once the new results are complete (``results``).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from batchjob.backends import open_backend
from batchjob.backends.base import FinishedRequest, RunSink
from batchjob.config import JobConfig
from batchjob.errors import AllRowsRejectedError, ConfigError, ModelError
from batchjob.faults import fault_point
from batchjob.heartbeat import Heartbeat
from batchjob.inputs import open_input
from batchjob.io import STATUS_KV_BUDGET, STATUS_OK
from batchjob.lock import output_lock
from batchjob.manifest import difference, manifest, read_manifest
from batchjob.output_layout import OutputLayout
from batchjob.plan.build import build_plan
from batchjob.plan.plan_io import write_plan
from batchjob.prompts import TokenizedPrompts
from batchjob.report import RunSummary, summarize, write_report
from batchjob.results import ResultRow, ResultSink
from batchjob.score_columns import job_columns
from batchjob.storage import ObjectPath
from batchjob.storage import configure as configure_storage
from batchjob.tokenize import load_prompts
from batchjob.tokenizer import PromptTokenizer, detokenize, load_tokenizer


@dataclass(frozen=True)
class JobResult:
    results_path: Path | ObjectPath  # ObjectPath: on an object store (batchjob.storage)
    report_paths: dict[str, Path | ObjectPath]
    summary: RunSummary | None  # None when the job was already complete


def _foreign(layout: OutputLayout, what: str, why: str) -> ConfigError:
    return ConfigError(
        f"output.path: {layout.output} {what} of another job: {why}. To replace them rerun "
        "with --set output.overwrite=true (they stay until the new results are complete); "
        "to keep them choose another output.path"
    )


def _resume_or_start(layout: OutputLayout, this: dict, overwrite: bool) -> bool:
    """False when the output already holds this job's complete results; True to run (resuming
    this job's parts if any). Another job's output: ConfigError, or with ``overwrite`` its
    parts are dropped and its results kept until the commit replaces them."""
    if layout.has_parts():
        why = difference(this, read_manifest(layout.parts_manifest))
        if why is None:
            return True  # resume: an interrupted overwrite run keeps its progress too
        if not overwrite:
            raise _foreign(layout, "holds unfinished parts", why)
    if layout.store.exists(layout.parts):  # another job's parts, or a manifest with no rows
        layout.drop_parts()
    if layout.complete() and not overwrite:
        why = difference(this, read_manifest(layout.manifest_file))
        if why is None:
            return False
        raise _foreign(layout, "holds results", why)
    return True


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
        settings=prompts.settings,  # keyed by row_id: valid for any selection
    )


def cap_to_context(prompts: TokenizedPrompts, max_model_len: int) -> TokenizedPrompts:
    """Per-row max_tokens cut to what the context leaves after the prompt: generation stops
    at the model's context with finish_reason "length", as in vLLM (prompts that leave no
    room were rejected as prompt_too_long)."""
    room = np.maximum(max_model_len - prompts.lengths, 1)
    capped = np.minimum(prompts.max_tokens.astype(np.int64), room).astype(np.int32)
    return dataclasses.replace(prompts, max_tokens=capped)


def _rows_over_budget(backend, prompts: TokenizedPrompts, plan) -> np.ndarray:
    """bool [N]: rows the backend says cannot fit its KV budget even alone (none if it
    cannot tell: then ``check_fits`` alone decides)."""
    probe = getattr(backend, "rows_over_budget", None)
    if probe is None or not len(prompts):
        return np.zeros(len(prompts), dtype=bool)
    return np.asarray(probe(prompts, plan), dtype=bool)


def _over_budget_row(prompts: TokenizedPrompts, i: int, budget: int | None) -> ResultRow:
    n, mt = int(prompts.lengths[i]), int(prompts.max_tokens[i])
    msg = (
        f"row {int(prompts.row_ids[i])}: prompt of {n} tokens + max_tokens {mt} does not fit "
        f"the KV cache (engine.kv_cache_bytes = {budget}) even alone; give the engine more "
        "KV memory or lower the row's max_tokens"
    )
    return ResultRow(int(prompts.row_ids[i]), None, None, n, 0, None, STATUS_KV_BUDGET, msg)


def _job_tokenizer(job: JobConfig, text_prompts: bool) -> PromptTokenizer | None:
    """Text prompts need the model's tokenizer; token ids use it only to decode the outputs,
    when the folder has one (else output_text stays null)."""
    if job.model.path is None:
        raise ModelError("model.path: required to run a job (a local Hugging Face model folder)")
    if text_prompts or (Path(job.model.path) / "tokenizer.json").is_file():
        return load_tokenizer(job.model.path)
    if job.sampling.stop:
        raise ConfigError(
            f"sampling.stop: stop strings need a tokenizer.json in {job.model.path} "
            "to decode the outputs"
        )
    return None


def _decode(tokenizer: PromptTokenizer | None, ids) -> str | None:
    return detokenize(tokenizer, [ids])[0] if tokenizer is not None else None


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _identity(this: dict, started: str) -> dict:
    """The report's job identity: the manifest's description + version and times."""
    return {
        **this["job"],
        "batchjob_version": this["fingerprint"]["batchjob.version"],
        "input_files": len(this["fingerprint"]["input.files"]),
        "num_rows": this["fingerprint"]["input.num_rows"],
        "started_at": started,
        "finished_at": _utc_now(),
    }


def run(job: JobConfig, progress: bool = True, heartbeat_s: float | None = None) -> JobResult:
    """Run ``job``; returns where results and report went and the summary.

    ``heartbeat_s``: print a progress line on stderr this often (the operator's log)."""
    t_job = time.perf_counter()
    started = _utc_now()
    configure_storage(job.storage)  # object-store settings, for a job not made by load_job
    layout = OutputLayout.of(job.output)
    dataset = open_input(job.input)  # metadata only: files and row count for the manifest
    layout.check(job.input.path, dataset.files)
    layout.prepare()
    with output_lock(layout.lock_file, layout.output):
        layout.clean_stale()
        this = manifest(job, dataset.files, dataset.num_rows)
        if not _resume_or_start(layout, this, job.output.overwrite):
            return JobResult(layout.output, {}, None)  # complete already: idempotent
        return _run_locked(
            job, layout, this, progress, t_job, heartbeat_s, started, dataset.prompt_is_text
        )


def _rejected_summary(loaded) -> str:
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(loaded.rejected.counts().items()))
    first = loaded.rejected.message[0] if len(loaded.rejected) else ""
    return f"every one of the {loaded.num_rows} input rows was rejected ({counts}); first: {first}"


def _run_locked(
    job: JobConfig,
    layout: OutputLayout,
    this: dict,
    progress: bool,
    t_job: float,
    heartbeat_s: float | None = None,
    started: str = "",
    text_prompts: bool = True,
) -> JobResult:
    stage: dict[str, float] = {}

    tokenizer = _job_tokenizer(job, text_prompts)  # once: encodes text, decodes outputs
    loaded, model = load_prompts(job, tokenizer)  # model: the folder, read once
    stage["read_s"], stage["tokenize_s"] = loaded.read.seconds, loaded.tokenize.seconds
    if len(loaded.prompts) == 0:
        raise AllRowsRejectedError(_rejected_summary(loaded))  # nothing written: fix the data
    sink = ResultSink(
        layout,
        this,
        flush_rows=job.output.flush_rows,
        rows_per_file=job.output.rows_per_file,
        extra_columns=job_columns(job),
    )
    done = sink.done_row_ids()
    prompts = select_rows(loaded.prompts, ~np.isin(loaded.prompts.row_ids, done))
    if model is not None:
        prompts = cap_to_context(prompts, model.max_model_len)
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
    stage["plan_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # no tokenizer, no stop strings (refused at load): the backend never needs text then
    backend = open_backend(job, lambda ids: _decode(tokenizer, ids) or "", model)
    over = _rows_over_budget(backend, prompts, plan)
    n_over = int(over.sum()) if not over.all() else 0
    if n_over:  # report those rows, run the rest (all: a config error)
        for i in np.flatnonzero(over):
            sink.add(_over_budget_row(prompts, int(i), job.engine.kv_cache_bytes))
        prompts = select_rows(prompts, ~over)
        plan = build_plan(prompts, enlarge=job.scheduler.enlarge, order=job.scheduler.reorder)
    backend.check_fits(prompts, plan)
    write_plan(plan, job.output.plan_file)
    stage["load_s"] = time.perf_counter() - t0

    lengths = prompts.lengths
    generated = 0
    bar = tqdm(total=len(prompts), unit="row", disable=not progress, desc="batchjob")

    finished = 0

    def on_finish(o: FinishedRequest) -> None:
        nonlocal generated, finished
        generated += len(o.token_ids)
        finished += 1
        text = o.text if o.text is not None else _decode(tokenizer, o.token_ids)
        sink.add(
            ResultRow(
                o.row_id,
                text,
                o.token_ids,
                int(lengths[o.position]),
                len(o.token_ids),
                o.finish_reason,
                o.status or STATUS_OK,
                o.message,
                output_logprobs=o.logprobs,
                label_logprobs=o.label_logprobs,
                label=o.label,
            )
        )
        bar.update(1)

    t_run = time.perf_counter()
    hb = Heartbeat(len(prompts), heartbeat_s) if heartbeat_s else None
    if hb:
        hb.say(
            f"{loaded.num_rows} rows: {len(prompts)} to run, {len(done)} done earlier, "
            f"{len(loaded.rejected) + n_over} rejected -> {layout.output}"
        )

    def on_iteration(_rec) -> None:
        if progress and _rec.iteration % 8 == 0:
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - t_run, 1e-9):.0f}")
        if hb:
            hb.beat(finished, generated, _rec.kv_bytes_used, job.engine.kv_cache_bytes or 0)

    try:
        run_info = backend.run(prompts, plan, RunSink(on_finish, on_iteration))
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
            "ok": len(loaded.prompts) - n_over,
            "rejected": len(loaded.rejected) + n_over,
            "skipped": len(done),
        },
        plan_ratios=(plan.stats.saving_ratio_single_level, plan.stats.saving_ratio_multi_level),
        total_s=time.perf_counter() - t_job,
        stage_s=stage,
        policy=job.scheduler.policy,
        device=backend.device,
        results=results_path,
    )
    summary = dataclasses.replace(summary, job=_identity(this, started))
    fault_point("report")
    paths = write_report(summary, run_info, job.output.report_file)
    if job.output.format == "openai-jsonl":  # from the committed results: a kill before
        from batchjob.openai_jsonl import write_responses  # cleanup redoes it on rerun

        assert isinstance(results_path, Path)  # refused at load for an object store
        paths["openai_jsonl"] = write_responses(job, results_path)
    sink.cleanup()  # after the report: a kill before here re-commits and re-reports on rerun
    return JobResult(results_path, paths, summary)
