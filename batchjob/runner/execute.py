"""Run a plan on one backend into a result sink: the step a single-machine job and every
cluster worker share (``pipeline`` calls it once; ``batchjob.runner.cluster`` once per shard).

Opens the job's backend, reports the rows that cannot fit its KV budget even alone (the rest
are re-planned without them), checks the plan fits, runs it, and adds every finished request
to the sink as a result row; whatever finished is flushed to disk even on a crash.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchjob.backends import open_backend
from batchjob.backends.base import Backend, BackendConfig, BackendRun, FinishedRequest, RunSink
from batchjob.backends.reasoning import reasoning_markers, split_reasoning
from batchjob.config import InputConfig, JobConfig, ModelConfig, SamplingConfig
from batchjob.errors import ConfigError, ModelError
from batchjob.model.info import ModelInfo
from batchjob.outputs.results import ResultRow, RowSink
from batchjob.plan.build import plan_job
from batchjob.plan.plan import Plan
from batchjob.plan.plan_io import write_plan
from batchjob.runner.heartbeat import Heartbeat
from batchjob.runner.progress import progress_bar
from batchjob.status import STATUS_KV_BUDGET, STATUS_OK
from batchjob.storage.atomic import Target
from batchjob.timing import calibration_s
from batchjob.tokenize.batched import TokenizedInput
from batchjob.tokenize.prompts import TokenizedPrompts
from batchjob.tokenize.samples import sample_counts
from batchjob.tokenize.tokenizer import PromptTokenizer, detokenize, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Execution:
    """What running a plan did (one backend, or the merge of a cluster's workers)."""

    run: BackendRun
    plan: Plan  # the plan that ran (without the rows over the KV budget)
    requests_run: int
    prompt_tokens: int
    generated_tokens: int
    over_budget: int  # rows reported as kv_budget_exceeded instead of run
    device: str
    load_s: float  # opening the backend and checking the plan
    calibration_s: float = 0.0  # kernel calibration in load and run (excluded from run.wall_s)


def job_tokenizer(
    model: ModelConfig, sampling: SamplingConfig, text_prompts: bool
) -> PromptTokenizer | None:
    """Text prompts need the model's tokenizer; token ids use it only to decode the outputs,
    when the folder has one (else output_text stays null)."""
    if model.path is None:
        raise ModelError("model.path: required to run a job (a model folder or Hub id)")
    folder = model.tokenizer or model.path
    if text_prompts or (Path(folder) / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    if sampling.stop:
        raise ConfigError(
            f"sampling.stop: stop strings need a tokenizer.json in {folder} to decode the outputs"
        )
    return None


def decode(
    tokenizer: PromptTokenizer | None, ids, sampling: SamplingConfig | None = None
) -> str | None:
    """``ids`` as output text, with the job's ``skip_special_tokens`` and
    ``spaces_between_special_tokens`` (vLLM's defaults without ``sampling``)."""
    return None if tokenizer is None else detokenize(tokenizer, [ids], sampling)[0]


def with_stop_string(cut: str, full: str, stops: tuple[str, ...]) -> str:
    """``include_stop_str_in_output``: the text a stop string cut (``cut``, a prefix of
    ``full``) with that stop string after it, the first of ``stops`` found there."""
    return cut + next((s for s in stops if full.startswith(s, len(cut))), "")


def select_rows(prompts: TokenizedPrompts, keep: np.ndarray) -> TokenizedPrompts:
    """The prompts whose ``keep`` flag is set (bool [N]), tokens compacted."""
    return prompts.take(np.asarray(keep, dtype=bool))


def cap_to_context(prompts: TokenizedPrompts, max_model_len: int) -> TokenizedPrompts:
    """Per-row max_tokens cut to what the context leaves after the prompt: generation stops
    at the model's context with finish_reason "length", as in vLLM (prompts that leave no
    room were rejected as prompt_too_long)."""
    room = np.maximum(max_model_len - prompts.lengths, 1)
    capped = np.minimum(prompts.max_tokens.astype(np.int64), room).astype(np.int32)
    return dataclasses.replace(prompts, max_tokens=capped)


def expected_results(loaded: TokenizedInput, samples: tuple[int, bool] = (1, False)) -> int:
    """How many result rows a job of ``loaded`` has: one per sample of every valid row, one
    per rejected row."""
    counts = sample_counts(loaded.prompts, samples[0]) if samples != (1, False) else None
    return len(loaded.rejected) + (len(loaded.prompts) if counts is None else int(counts.sum()))


def job_samples(sampling: SamplingConfig, inp: InputConfig) -> tuple[int, bool]:
    """(sampling.n, whether rows set their own n): what ``Prepared.requests`` expands."""
    return sampling.n, inp.n_column is not None


def _rows_over_budget(backend: Backend, prompts: TokenizedPrompts, plan: Plan) -> np.ndarray:
    """bool [N]: rows the backend says cannot fit its KV budget even alone."""
    if not len(prompts):
        return np.zeros(0, dtype=bool)
    return np.asarray(backend.rows_over_budget(prompts, plan), dtype=bool)


def _over_budget_row(prompts: TokenizedPrompts, i: int, budget: int | None) -> ResultRow:
    n, mt = int(prompts.lengths[i]), int(prompts.max_tokens[i])
    msg = (
        f"row {int(prompts.row_ids[i])}: prompt of {n} tokens + max_tokens {mt} does not fit "
        f"the KV cache (engine.kv_cache_bytes = {budget}) even alone; give the engine more "
        "KV memory or lower the row's max_tokens"
    )
    row = ResultRow(int(prompts.row_ids[i]), None, None, n, 0, None, STATUS_KV_BUDGET, msg)
    return dataclasses.replace(row, sample_index=_sample_of(prompts, i))


def _row_stops(sampling: SamplingConfig, prompts: TokenizedPrompts, i: int) -> tuple[str, ...]:
    """Request ``i``'s stop strings: its row's (``input.stop_column``), else the job's."""
    rs = prompts.settings
    own = None if rs is None or rs.stop is None else rs.stop[rs.index(int(prompts.row_ids[i]))]
    return sampling.stop if own is None else own


def _sample_of(prompts: TokenizedPrompts, i: int) -> int | None:
    return None if prompts.sample_index is None else int(prompts.sample_index[i])


def open_job_backend(
    cfg: BackendConfig, tokenizer: PromptTokenizer | None, model: ModelInfo | None = None
) -> Backend:
    """The job's backend, loaded (model weights, KV cache) and ready to run plans."""
    # no tokenizer, no stop strings (refused at load): the backend never needs text then
    return open_backend(cfg, lambda ids: decode(tokenizer, ids, cfg.sampling) or "", model)


def backend_config(job: JobConfig) -> BackendConfig:
    """The part of a job that a backend runs with."""
    return BackendConfig(
        model=job.model,
        sampling=job.sampling,
        scheduler=job.scheduler,
        engine=job.engine,
        labels_column=job.input.labels_column,
        json_schema_column=job.input.json_schema_column,
        regex_column=job.input.regex_column,
        choice_column=job.input.choice_column,
        reasoning_parser=job.output.reasoning_parser,
    )


def check_reasoning(parser: str | None, tokenizer: PromptTokenizer | None) -> None:
    """``output.reasoning_parser`` can split this model's outputs: its tokenizer decodes them
    and has the parser's markers as tokens it keeps (else ConfigError naming the key)."""
    if parser is None:
        return
    if tokenizer is None:
        raise ConfigError(
            f"output.reasoning_parser: {parser!r} needs the model's tokenizer.json to decode "
            "the outputs"
        )
    try:
        reasoning_markers(parser, tokenizer.tokenizer)
    except ValueError as e:
        raise ConfigError(f"output.reasoning_parser: {e}") from None


def execute(
    cfg: BackendConfig,
    prompts: TokenizedPrompts,
    plan: Plan,
    sink: RowSink,
    tokenizer: PromptTokenizer | None,
    model: ModelInfo | None = None,
    *,
    backend: Backend | None = None,
    plan_file: Target | None = None,
    progress: bool = False,
    heartbeat_s: float | None = None,
    headline: Callable[[int, int], str] | None = None,
) -> Execution:
    """Run ``plan`` over ``prompts`` on the backend of ``cfg``, every outcome into ``sink``.

    ``backend``: one opened earlier (``open_job_backend``), kept open for the caller's next
    plan (``batchjob.Generator``); None: opened here and closed when the plan is done.
    ``plan_file``: where the plan that runs is written (None: not written); ``headline(to_run,
    over_budget)``: the run's start line on stderr, under a progress bar or heartbeat."""
    t0, calibrated0 = time.perf_counter(), calibration_s()
    check_reasoning(cfg.reasoning_parser, tokenizer)
    owned = backend is None
    if backend is None:
        backend = open_job_backend(cfg, tokenizer, model)
    over = _rows_over_budget(backend, prompts, plan)
    n_over = int(over.sum()) if not over.all() else 0
    if n_over:  # report those rows, run the rest (all: a config error)
        for i in np.flatnonzero(over):
            sink.add(_over_budget_row(prompts, int(i), cfg.engine.kv_cache_bytes))
        prompts = select_rows(prompts, ~over)
        plan = plan_job(prompts, cfg.scheduler)
    backend.check_fits(prompts, plan)
    if plan_file is not None:
        write_plan(plan, plan_file)
    load_s = time.perf_counter() - t0
    log.info("stage load done in %.2f s", load_s)

    lengths = prompts.lengths
    generated = 0
    finished = 0
    if headline is not None and (progress or heartbeat_s):  # the start line, before the bar
        print(f"batchjob: {headline(len(prompts), n_over)}", file=sys.stderr, flush=True)
    bar = progress_bar(len(prompts), progress)
    keep_stop = cfg.sampling.include_stop_str_in_output

    def on_finish(o: FinishedRequest) -> None:
        nonlocal generated, finished
        generated += len(o.token_ids)
        finished += 1
        embedded = o.embedding is not None  # nothing generated: no text to decode
        text = o.text
        if text is None and not embedded:
            text = decode(tokenizer, o.token_ids, cfg.sampling)
        elif text is not None and keep_stop and o.finish_reason == "stop":  # a stop string cut it
            full = decode(tokenizer, o.token_ids, cfg.sampling) or ""
            text = with_stop_string(text, full, _row_stops(cfg.sampling, prompts, o.position))
        reasoning = None
        if cfg.reasoning_parser is not None and text is not None:
            reasoning, text = split_reasoning(cfg.reasoning_parser, text)
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
                prompt_logprobs=(
                    None
                    if o.prompt_logprobs is None
                    else (prompts.row(o.position), o.prompt_logprobs)
                ),
                label_logprobs=o.label_logprobs,
                label=o.label,
                sample_index=_sample_of(prompts, o.position),
                reasoning_text=reasoning,
                embedding=o.embedding,
            )
        )
        bar.update(1)

    t_run = time.perf_counter()
    hb = Heartbeat(len(prompts), heartbeat_s) if heartbeat_s else None

    def on_iteration(_rec) -> None:
        if progress and _rec.iteration % 8 == 0:
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - t_run, 1e-9):.0f}")
        if hb:
            hb.beat(finished, generated, _rec.kv_bytes_used, cfg.engine.kv_cache_bytes or 0)

    try:
        run_info = backend.run(prompts, plan, RunSink(on_finish, on_iteration))
    finally:
        bar.close()
        if owned:
            backend.close()
        sink.flush()  # whatever finished is on disk, even on Ctrl-C or a crash
    return Execution(
        run=run_info,
        plan=plan,
        requests_run=len(prompts),
        prompt_tokens=int(lengths.sum()),
        generated_tokens=generated,
        over_budget=n_over,
        device=backend.device,
        load_s=load_s,
        calibration_s=calibration_s() - calibrated0,
    )


def merge(runs: list[Execution], plan: Plan, device: str, wall_s: float) -> Execution:
    """One Execution of several workers' (a cluster's): counts summed, iterations in worker
    order, peak KV the largest worker's, ``wall_s`` the cluster's."""
    its = [it for e in runs for it in e.run.iterations]
    run = BackendRun(
        iterations=its,
        computed_prefill_tokens=sum(e.run.computed_prefill_tokens for e in runs),
        recomputed_tokens=sum(e.run.recomputed_tokens for e in runs),
        preemptions=sum(e.run.preemptions for e in runs),
        peak_kv_bytes=max((e.run.peak_kv_bytes for e in runs), default=0),
        kv_budget_bytes=max((e.run.kv_budget_bytes for e in runs), default=0),
        wall_s=wall_s,
        calibration_s=max((e.run.calibration_s for e in runs), default=0.0),
    )
    return Execution(
        run=run,
        plan=plan,
        requests_run=sum(e.requests_run for e in runs),
        prompt_tokens=sum(e.prompt_tokens for e in runs),
        generated_tokens=sum(e.generated_tokens for e in runs),
        over_budget=sum(e.over_budget for e in runs),
        device=device,
        load_s=max((e.load_s for e in runs), default=0.0),
        calibration_s=max((e.calibration_s for e in runs), default=0.0),
    )
