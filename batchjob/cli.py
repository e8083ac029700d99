"""The `batchjob` command line: one click group, thin commands.

Every command that takes a job gets the same options through ``@job_options``: a job file
(optional), repeatable ``--set section.key=value`` and the shortcuts ``--input``,
``--output`` and ``--model``; the command receives a validated ``JobConfig`` as ``job``.

Errors: a ``BatchJobError`` prints one line ``error: ...`` on stderr and exits with its
exit code (batchjob.errors); Ctrl-C or SIGTERM exits with 130; an ``OSError`` (disk full, lost
mount) prints one line and exits 1. Anything else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from batchjob.config import JobConfig, load_job, parse_assignments
from batchjob.errors import (
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    BatchJobError,
    ConfigError,
    one_line,
)
from batchjob.tokenize.tokenizer import parallelism_disabled
from batchjob.version import __version__

log = logging.getLogger("batchjob")


class _Group(click.Group):
    """Maps BatchJobError and interrupts to exit codes, without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BatchJobError as e:
            click.echo(f"error: {one_line(e)}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            if signal.getsignal(signal.SIGINT) is _interrupted_again:  # a signal stopped us:
                for sig in (signal.SIGINT, signal.SIGTERM):  # one more cannot change the code
                    signal.signal(sig, signal.SIG_IGN)  # while the interpreter shuts down
            ctx.exit(EXIT_INTERRUPTED)
        except OSError as e:  # disk full, a lost mount: the machine's problem, retry may help
            why = one_line(e)
            click.echo(f"error: {why}; rows written so far are kept: rerun to resume", err=True)
            ctx.exit(EXIT_RUNTIME)


def _interrupted(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM (Ctrl-C, Airflow, cron): stop the work by KeyboardInterrupt; the rows
    written are flushed and kept. A second signal while it stops: ``_interrupted_again``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted_again)
    raise KeyboardInterrupt


def _interrupted_again(signum: int, frame: object) -> None:
    """Exit 130 at once: what is on disk is whole (atomic parts), as after a kill."""
    os.write(2, b"interrupted again: stopping now; rows written are kept\n")
    os._exit(EXIT_INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchjob")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv: debug).")
def main(verbose: int) -> None:
    """Offline batch LLM inference for prefix-shared Parquet datasets."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):  # Airflow/cron stop: same path as Ctrl-C
            signal.signal(sig, _interrupted)
    if parallelism_disabled():
        log.warning(
            "TOKENIZERS_PARALLELISM=%s: tokenization runs on one core",
            os.environ["TOKENIZERS_PARALLELISM"],
        )


def job_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add JOB + --set/--input/--output/--model; call ``f(job=JobConfig, **other_options)``."""

    @click.argument("job_file", metavar="[JOB.toml]", required=False, type=click.Path())
    @click.option(
        "--set",
        "sets",
        multiple=True,
        metavar="SECTION.KEY=VALUE",
        help="Override any job key (value: TOML literal or text). Repeatable.",
    )
    @click.option("--input", "input_path", metavar="PATH", help="= --set input.path=PATH")
    @click.option("--output", "output_path", metavar="PATH", help="= --set output.path=PATH")
    @click.option(
        "--model", "model_path", metavar="PATH|ORG/NAME", help="= --set model.path=(a Hub id too)"
    )
    @functools.wraps(f)
    def wrapper(
        job_file: str | None,
        sets: tuple[str, ...],
        input_path: str | None,
        output_path: str | None,
        model_path: str | None,
        **kwargs: Any,
    ) -> Any:
        job = build_job(job_file, sets, input_path, output_path, model_path)
        return f(job=job, **kwargs)

    return wrapper


def build_job(
    job_file: str | None,
    sets: tuple[str, ...] | list[str] = (),
    input_path: str | None = None,
    output_path: str | None = None,
    model_path: str | None = None,
) -> JobConfig:
    """JobConfig from a job file and command-line overrides (shortcuts win over --set)."""
    overrides = parse_assignments(list(sets))
    for key, value in (
        ("input.path", input_path),
        ("output.path", output_path),
        ("model.path", model_path),
    ):
        if value is not None:
            overrides[key] = value
    return load_job(job_file, overrides)


@main.command("plan")
@job_options
@click.option("--plan-out", type=click.Path(path_type=Path), help="Default: output.plan_path.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def plan_cmd(job: JobConfig, plan_out: Path | None, as_json: bool) -> None:
    """Read, tokenize and plan a job; print a summary and write the plan (no model run)."""
    from batchjob.inputs.source import open_input
    from batchjob.model.pooling import describe_embedding
    from batchjob.outputs.naming import OutputLayout
    from batchjob.outputs.plan_summary import summarize
    from batchjob.plan.build import plan_job
    from batchjob.plan.plan_io import write_plan
    from batchjob.runner.plan_stream import partitioned_reason
    from batchjob.runner.prepare import prepare
    from batchjob.timing import StageTiming

    dataset = open_input(job.input, job.model, job.sampling)  # metadata: rows, files
    if why := partitioned_reason(job, dataset):
        log.info(why)
        _plan_partitioned(job, dataset, plan_out, as_json)
        return
    # the requests `batchjob run` runs: every row's samples (sampling.n), context-capped
    data = prepare(job, dataset=dataset)
    prompts = data.requests()
    loaded = data.loaded
    log.info("stage tokenize done: %d rows, %d tokens", loaded.num_rows, len(loaded.prompts.tokens))
    t0 = time.perf_counter()
    plan = plan_job(prompts, job.scheduler)
    plan_s = time.perf_counter() - t0
    log.info("stage plan done in %.2f s", plan_s)
    logical = len(prompts.tokens)
    target = plan_out or OutputLayout.of(job.output).plan_file
    path = target.expanduser().resolve() if isinstance(target, Path) else target  # or a URI
    try:
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
        write_plan(plan, path)
    except OSError as e:
        key = "--plan-out" if plan_out else "output.path"
        raise ConfigError(f"{key}: cannot write the plan to {path}: {e.strerror or e}") from None
    log.info("stage write done (plan file)")
    stages = (loaded.read, loaded.tokenize, StageTiming("plan", plan_s, len(prompts), logical))
    summary = summarize(
        plan, prompts, loaded.rejected, stages, model=data.model, plan_path=str(path)
    )
    summary = dataclasses.replace(summary, embedding=describe_embedding(job.model, data.model))
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        click.echo(summary.format())


def _plan_partitioned(job: JobConfig, dataset, plan_out: Path | None, as_json: bool) -> None:
    """`batchjob plan` of a dataset over scheduler.plan_memory: streamed, in partitions."""
    from batchjob.model.pooling import describe_embedding
    from batchjob.outputs.naming import OutputLayout
    from batchjob.outputs.plan_summary import summarize_partitioned
    from batchjob.runner.plan_stream import plan_partitioned

    layout = OutputLayout.of(job.output)
    target = plan_out or layout.plan_file
    path = target.expanduser().resolve() if isinstance(target, Path) else target  # or a URI
    planner = plan_partitioned
    if job.cluster.address != "none":  # the workers spill and plan (Ray imported only here)
        from batchjob.runner.cluster.partitioned import cannot_partition, plan_on_cluster

        if (why := cannot_partition(job, layout)) is None:
            planner = plan_on_cluster
        else:
            log.info("%s: planned in this process", why)
    try:
        done = planner(job, path, layout.meta, dataset=dataset)
    except OSError as e:
        key = "--plan-out" if plan_out else "output.path"
        raise ConfigError(f"{key}: cannot write the plan to {path}: {e.strerror or e}") from None
    log.info("stage plan done in %.2f s", done.stages[-1].seconds)
    log.info("stage write done (plan file)")
    summary = summarize_partitioned(
        done.planned, done.rejected, done.stages, done.budget, done.model, str(path)
    )
    summary = dataclasses.replace(summary, embedding=describe_embedding(job.model, done.model))
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else summary.format())


@main.command("run")
@job_options
@click.option("--no-progress", is_flag=True, help="No progress bar (logs, cron).")
@click.option("--json", "as_json", is_flag=True, help="Print the run summary as JSON on stdout.")
def run_cmd(job: JobConfig, no_progress: bool, as_json: bool) -> None:
    """Run a job: read, tokenize, plan, generate; write results and a throughput report.

    Results stream to atomic part files; rerun an interrupted job with the same arguments
    and it skips the rows already written. A job whose results file exists is not rerun
    unless output.overwrite is set.
    """
    import dataclasses

    from batchjob.runner.heartbeat import interval_from_env
    from batchjob.runner.pipeline import run
    from batchjob.runner.progress import results_phrase

    tty = sys.stderr.isatty()
    result = run(
        job, progress=not no_progress and tty, heartbeat_s=None if tty else interval_from_env()
    )
    if result.summary is None:
        if as_json:
            click.echo(json.dumps({"results": str(result.results_path), "already_complete": True}))
        else:
            click.echo(f"{result.results_path}: already complete (set output.overwrite to rerun)")
        return
    s = result.summary
    if as_json:
        out = dataclasses.asdict(s) | {"results": str(result.results_path)}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(
        f"{results_phrase(s.rows_total, s.input_rows)}: {s.rows_ok} ok, "
        f"{s.rows_rejected} rejected, "
        f"{s.rows_skipped_done} done earlier -> {result.results_path}\n"
        + _rates(s)
        + f"; TECD {s.tecd_s:.2f} s; total {s.total_s:.2f} s\n"
        + f"saving ratio: planned {s.saving_ratio_planned:.1%} (multi-level optimum "
        f"{s.saving_ratio_multi_level:.1%}), achieved {s.saving_ratio_achieved:.1%}; "
        f"{s.iterations} iterations, {s.mean_tokens_per_iteration:.0f} tokens/iteration, "
        f"{s.preemptions} preemptions\n"
        f"report: {result.report_paths.get('json')}"
    )


def _rates(s: Any) -> str:
    """The run line's throughput: rows/s and prompt tokens/s of an embedding job."""
    if s.task == "embed":
        return (
            f"{s.requests_run} rows embedded in {s.engine_s:.2f} s ({s.requests_per_s:.2f} "
            f"rows/s, {s.prompt_tokens_per_s:.0f} tokens/s)"
        )
    return (
        f"{s.requests_run} requests in {s.engine_s:.2f} s ({s.requests_per_s:.2f} req/s, "
        f"{s.prompt_tokens_per_s:.0f} prompt tok/s, {s.generated_tokens_per_s:.0f} generated "
        "tok/s)"
    )


@main.command("keys")
@click.argument("section", required=False)
@click.option("--markdown", is_flag=True, help="The tables of docs/job_file.md.")
def keys_cmd(section: str | None, markdown: bool) -> None:
    """Every job-file key (of SECTION): type, default, allowed values and meaning."""
    from batchjob.config import SECTIONS
    from batchjob.config.keys import format_markdown, format_text, markdown_blocks

    if section is not None and section not in SECTIONS:
        near = difflib.get_close_matches(section, list(SECTIONS), n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(
            f"unknown section {section!r}{hint} (expected one of {', '.join(SECTIONS)})"
        )
    if markdown:
        click.echo(format_markdown(section) if section else markdown_blocks())
    else:
        click.echo(format_text(section))


if __name__ == "__main__":
    main()
