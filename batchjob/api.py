"""The Python API: ``run`` a job, or ``generate`` over data held in memory.

``generate(data, model=..., **sections)`` takes a pyarrow Table, a polars or pandas DataFrame,
or a list of prompts (text, or token-id lists) and returns one pyarrow Table: a result row per
input row, in input order, with the same columns as the results files of ``batchjob run`` (the
input's columns passed through). It runs the stages ``batchjob run`` runs, the same functions:
the table is read as an in-memory dataset (``batchjob.inputs.table``), tokenized with the
per-row settings and its rows expanded into requests (``batchjob.runner.prepare``), its
rejected rows reported, planned
(``plan_job``) and run on the job's backend (``execute``) into an in-memory sink
(``batchjob.outputs.memory``) instead of part files. Nothing is written to disk.

Settings are the job file's sections, as keyword arguments holding tables of their keys::

    batchjob.generate(df, model="models/tiny-llama",
                      sampling={"max_tokens": 16, "temperature": 0.7},
                      engine={"kv_cache_bytes": "1GiB"})

is ``[sampling] max_tokens = 16 ...`` of a job file; ``model`` takes the model folder (or the
``[model]`` table), ``job`` a job file or ``JobConfig`` to start from (its ``[output]``,
``[cluster]`` and ``[storage]`` do not apply). Every value is checked by the same section
dataclasses as a job file's: a bad one raises the same ``ConfigError``.

``Generator(model=..., **sections)`` loads the model once: each ``.generate(data)`` reuses the
loaded backend. ``generate_batches(data, ...)`` takes an iterable of tables (or one table,
read ``input.batch_rows`` rows at a time) and yields one result table per input table, each
planned and run on its own, so memory stays flat however long the stream: a window is what
is planned at once, an input table, or a slice of one whose in-memory planning
(``plan.budget.plan_bytes``, its tokens estimated from the prompt column) would exceed
``scheduler.plan_memory``. Rows share prefixes within a window, not across windows.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchjob.config import SECTIONS, JobConfig, load_job
from batchjob.config.load import IMPLICIT_MAX_TOKENS_COLUMN, build_job, closest_key, read_tables
from batchjob.config.vllm_values import is_engine_arg, is_sampling_params, sampling_table
from batchjob.errors import ConfigError, InputDataError
from batchjob.inputs.table import DATA_NAME

if TYPE_CHECKING:
    from batchjob.backends.base import Backend
    from batchjob.runner.pipeline import JobResult
    from batchjob.tokenize.tokenizer import PromptTokenizer

_OUTPUT_KEYS = ("reasoning_parser",)  # the [output] keys generate() honours: what it returns
_NOT_HERE = {
    "output": "generate() returns a table and writes nothing (batchjob.run writes results); "
    "of [output] it takes reasoning_parser only",
    "cluster": "generate() runs in this process (for many machines: a Generator per Ray actor)",
    "storage": "generate() reads no files",
}


def run(job: JobConfig | str | Path, progress: bool = False) -> JobResult:
    """Run a job (a ``JobConfig`` or a path to its TOML file), as ``batchjob run`` does:
    results and report written, resumable; returns where they went and the run summary."""
    from batchjob.runner.pipeline import run as run_job

    return run_job(job if isinstance(job, JobConfig) else load_job(job), progress=progress)


def generate_config(
    model: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    job: str | os.PathLike[str] | JobConfig | None = None,
    **sections: Mapping[str, Any],
) -> JobConfig:
    """The job ``generate`` runs: ``job`` (a file or ``JobConfig``), then the ``sections``
    tables, checked as a job file's; its input is the data given to ``generate``."""
    if is_sampling_params(sections.get("sampling")):  # a vllm.SamplingParams, field by field
        keys = frozenset(f.name for f in dataclasses.fields(SECTIONS["sampling"]))
        sections = {**sections, "sampling": sampling_table(sections["sampling"], keys)}
    tables: dict[str, dict[str, Any]] = {}
    for name, table in sections.items():
        if name not in SECTIONS:
            near = difflib.get_close_matches(name, list(SECTIONS), n=1)
            key = closest_key("", name)
            hint = ""
            if near:
                hint = f"; did you mean {near[0]}={{...}}?"
            elif key is not None and key.endswith("." + name):  # a key outside its table
                section = key.split(".")[0]
                hint = f"; settings go in their section's table: {section}={{{name!r}: ...}}"
            elif is_engine_arg(name):  # LLM(tensor_parallel_size=2)
                hint = (
                    f"; a vLLM engine argument goes in engine={{'backend': 'vllm', "
                    f"'vllm': {{{name!r}: ...}}}}"
                )
            elif key is not None:
                section, k = key.split(".")
                hint = f"; did you mean {section}={{{k!r}: ...}}?"
            raise ConfigError(f"generate(): unknown setting {name}=...{hint}")
        if name == "output" and isinstance(table, Mapping) and set(table) <= {*_OUTPUT_KEYS}:
            pass
        elif name in _NOT_HERE:
            raise ConfigError(f"{name}: not a setting of generate(): {_NOT_HERE[name]}")
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"{name}: must be a table of [{name}] keys, e.g. "
                f"sampling={{'max_tokens': 16}}, got {table!r}"
            )
        tables[name] = dict(table)
    if isinstance(model, Mapping):
        tables["model"] = {**tables.get("model", {}), **model}
    elif model is not None:
        tables.setdefault("model", {})["path"] = model
    if "path" in tables.get("input", {}):
        raise ConfigError("input.path: generate() reads its data argument (batchjob.run: files)")
    base: Path | None = None
    if isinstance(job, JobConfig):
        given = job.to_dict()
        for name in given:
            given[name] = {**given[name], **tables.get(name, {})}
        tables, source = given, job.source
    else:
        base, source = (None if job is None else Path(job)), None
    raw, file, where = read_tables(base, tables=tables, where="generate()")
    raw["input"] = {**raw.get("input", {}), "path": DATA_NAME}
    given = raw.get("output", {})
    raw["output"] = {"path": DATA_NAME, **{k: given[k] for k in _OUTPUT_KEYS if k in given}}
    for name in ("cluster", "storage"):
        raw.pop(name, None)
    built = build_job(raw, file or source, where)
    # sampling={"max_tokens": N} in code over data with a max_tokens column it did not name:
    # the column still sets each row's limit, said in one line when the data has it
    in_code = "max_tokens" in sections.get("sampling", {})
    named = "max_tokens_column" in {**raw_input_of(job), **sections.get("input", {})}
    object.__setattr__(built.input, IMPLICIT_MAX_TOKENS_COLUMN, in_code and not named)
    return built


def raw_input_of(job: str | os.PathLike[str] | JobConfig | None) -> dict[str, Any]:
    """The [input] keys a job file writes ({} for none or a JobConfig, whose keys the code
    chose)."""
    if job is None or isinstance(job, JobConfig):
        return {}
    raw, _, _ = read_tables(Path(job))
    return raw.get("input", {})


# ---------------------------------------------------------------------------------------
# data in


def _is_prompt_list(data: Any) -> bool:
    """A list of prompts: text, or token-id lists (lists, tuples, numpy arrays)."""
    if not isinstance(data, Sequence) or isinstance(data, str | bytes):
        return False
    first = next((x for x in data if x is not None), None)
    return (
        first is None
        or isinstance(first, str | Sequence | pa.Array)
        or type(first).__module__ == "numpy"
    )


def _is_one_table(data: Any) -> bool:
    """One table (not a stream of them): a pyarrow Table or RecordBatch, a DataFrame, or a
    list of prompts."""
    frame = type(data).__module__.split(".")[0] in ("polars", "pandas")
    return isinstance(data, pa.Table | pa.RecordBatch) or frame or _is_prompt_list(data)


def as_table(data: Any, column: str = "prompt") -> pa.Table:
    """``data`` as an Arrow table: a pyarrow Table or RecordBatch, a polars or pandas
    DataFrame, anything with ``__arrow_c_stream__``, or a list of prompts (text or token-id
    lists, into ``column``: the job's ``input.prompt_column``)."""
    if isinstance(data, pa.Table):
        table = data
    elif isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif type(data).__module__.startswith("polars") and hasattr(data, "to_arrow"):
        table = data.to_arrow()  # large_string, not string_view
    elif type(data).__module__.startswith("pandas") and hasattr(data, "iloc"):
        table = pa.Table.from_pandas(data, preserve_index=False)
    elif hasattr(data, "__arrow_c_stream__"):
        table = pa.table(data)
    elif _is_prompt_list(data):
        first = next((x for x in data if x is not None), "")
        kind = pa.large_string() if isinstance(first, str) else pa.list_(pa.int64())
        try:
            table = pa.table({column: pa.array(list(data), kind)})
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise InputDataError(
                f"{DATA_NAME}: prompts must be all text or all token-id lists: {e}"
            ) from None
    else:
        raise InputDataError(
            f"{DATA_NAME}: expected a pyarrow Table, a polars or pandas DataFrame or a list of "
            f"prompts, got {type(data).__name__}"
        )
    views = {pa.string_view(): pa.large_string(), pa.binary_view(): pa.large_binary()}
    if any(f.type in views for f in table.schema):
        table = table.cast(
            pa.schema([f.with_type(views.get(f.type, f.type)) for f in table.schema])
        )
    return table


def _chunks(data: Any, rows: int, prompt_column: str) -> Iterator[pa.Table]:
    """The tables of a stream (any other iterable: a generator of DataFrames, a
    ``RecordBatchReader``), or one table read ``rows`` rows at a time."""
    if not _is_one_table(data) and isinstance(data, Iterable):
        for item in data:
            yield as_table(item, prompt_column)
        return
    table = as_table(data, prompt_column)
    for start in range(0, max(table.num_rows, 1), rows):
        yield table.slice(start, rows)


def _estimated_tokens(table: pa.Table, column: str) -> int:
    """A table's prompt tokens before tokenizing: a token-id column's values, a text
    column's bytes / 4; without the column (a template, chat messages) every text column's."""
    import pyarrow.compute as pc

    def text_bytes(col) -> int:
        return int(pc.sum(pc.binary_length(col)).as_py() or 0)

    if column in table.column_names:
        col = table[column]
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            return int(pc.sum(pc.list_value_length(col)).as_py() or 0)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            return text_bytes(col) // 4
    texts = [
        c for c in table.columns if pa.types.is_string(c.type) or pa.types.is_large_string(c.type)
    ]
    return sum(text_bytes(c) for c in texts) // 4


def window_rows(table: pa.Table, job: JobConfig) -> int:
    """Rows of ``table`` planned at once by ``generate_batches``: all of them, or as many as
    keep the window's estimated planning memory within ``FILL`` of ``scheduler.plan_memory``
    (as a partition of ``batchjob plan``), at least one."""
    from batchjob.plan.budget import FILL, budget_of, plan_bytes

    n = table.num_rows
    if not n:
        return 1
    need = plan_bytes(n, _estimated_tokens(table, job.input.prompt_column))
    budget = budget_of(job.scheduler.plan_memory)
    if need <= budget:
        return n
    return max(1, int(n * budget * FILL // need))


# ---------------------------------------------------------------------------------------
# running


class Generator:
    """A job's settings and its loaded engine, for many ``generate`` calls.

    ``with batchjob.Generator(model="models/m", sampling={"max_tokens": 16}) as g:``
    ``g.generate(df)`` loads the model on the first call and keeps it; ``close()`` (or the
    end of the ``with`` block) frees it."""

    def __init__(
        self,
        model: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        *,
        job: str | os.PathLike[str] | JobConfig | None = None,
        progress: bool = False,
        **sections: Mapping[str, Any],
    ) -> None:
        self.job = generate_config(model, job, **sections)
        self.progress = progress
        self._tokenizer: PromptTokenizer | None = None
        self._tokenizer_checked = False
        self._backend: Backend | None = None

    def generate(self, data: Any) -> pa.Table:
        """One result row per row of ``data`` (row_id 0..N-1), in input order; with
        ``sampling.n``, one per sample (``sample_index``), samples of a row together."""
        return self._run(as_table(data, self.job.input.prompt_column), row_base=0)

    def generate_batches(self, data: Any) -> Iterator[pa.Table]:
        """One result table per input table of ``data`` (an iterable of tables or
        DataFrames, or one table read ``input.batch_rows`` rows at a time); row ids count on
        across tables. Each table is planned on its own: rows that share prefixes share them
        within a table."""
        base = 0
        left = self.job.input.limit
        inp = self.job.input
        for table in _chunks(data, inp.batch_rows, inp.prompt_column):
            if left is not None:
                if left <= 0:
                    return
                table = table.slice(0, left)
                left -= table.num_rows
            yield self._run_windows(table, row_base=base)
            base += table.num_rows

    def _run_windows(self, table: pa.Table, row_base: int) -> pa.Table:
        """``_run`` of ``table`` in windows within ``scheduler.plan_memory`` (the module
        doc); one window when it fits."""
        rows = window_rows(table, self.job)
        if rows >= table.num_rows:
            return self._run(table, row_base=row_base)
        outs = [
            self._run(table.slice(start, rows), row_base=row_base + start)
            for start in range(0, table.num_rows, rows)
        ]
        return pa.concat_tables(outs, promote_options="permissive")

    def _run(self, table: pa.Table, row_base: int) -> pa.Table:
        from batchjob.inputs.table import open_table
        from batchjob.outputs.memory import MemorySink
        from batchjob.outputs.score_columns import job_columns
        from batchjob.plan.build import plan_job
        from batchjob.runner.execute import backend_config, execute, open_job_backend
        from batchjob.runner.prepare import prepare

        job = self.job
        sink = MemorySink(
            job_columns(job.sampling, job.input, job.output.reasoning_parser, job.model.task)
        )
        dataset = open_table(job.input, job.model, table, row_base=row_base)
        tokenizer = self._tokenizer_once(dataset.prompt_is_text)
        prep = prepare(job, tokenizer, dataset=dataset)
        info = prep.model
        prompts = prep.requests()  # every row's samples
        prep.report_rejected(sink)  # one result row per rejected row
        if len(prompts):
            plan = plan_job(prompts, job.scheduler)
            cfg = backend_config(job)
            if self._backend is None:
                self._backend = open_job_backend(cfg, tokenizer, info)
            execute(
                cfg,
                prompts,
                plan,
                sink,
                tokenizer,
                info,
                backend=self._backend,
                progress=self.progress,
            )
        return sink.table(prep.loaded.passthrough, prep.expected)

    def _tokenizer_once(self, text: bool) -> PromptTokenizer | None:
        """The model's tokenizer, loaded once; None for token-id prompts when the folder has
        no tokenizer.json (then text prompts later raise ModelError)."""
        from batchjob.runner.execute import job_tokenizer

        if not self._tokenizer_checked or (text and self._tokenizer is None):
            self._tokenizer = job_tokenizer(self.job.model, self.job.sampling, text)
            self._tokenizer_checked = True
        return self._tokenizer

    def close(self) -> None:
        """Free the loaded engine (the next ``generate`` loads it again)."""
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def generate(
    data: Any,
    model: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    job: str | os.PathLike[str] | JobConfig | None = None,
    progress: bool = False,
    **sections: Mapping[str, Any],
) -> pa.Table:
    """Generate for every row of ``data``; one result row per input row, in input order.
    See the module docstring for ``data`` and the settings."""
    with Generator(model, job=job, progress=progress, **sections) as g:
        return g.generate(data)


def generate_batches(
    data: Any,
    model: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    job: str | os.PathLike[str] | JobConfig | None = None,
    progress: bool = False,
    **sections: Mapping[str, Any],
) -> Iterator[pa.Table]:
    """``Generator.generate_batches`` with a Generator of its own, closed at the end."""
    with Generator(model, job=job, progress=progress, **sections) as g:
        yield from g.generate_batches(data)
