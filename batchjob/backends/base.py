"""The one interface the pipeline calls: tokenized prompts + plan in, finished requests out.

A backend is opened for one job (``open_backend``), then ``run`` executes the plan and hands
every finished request to ``sink.on_finish`` as soon as it finishes (results stream to disk), and
every iteration's record to ``sink.on_iteration`` (report, timeline plot, progress). Backends know
nothing of Parquet; the pipeline knows nothing of models, KV caches or schedulers.

``Backend`` is an abstract class: every backend implements every method, so a rule the
pipeline applies through the contract (a row over the KV budget is reported, the rest runs)
holds on all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from batchjob.config import (
    EngineConfig,
    ModelConfig,
    OutputConfig,
    SamplingConfig,
    SchedulerConfig,
)
from batchjob.plan.plan import Plan
from batchjob.tokenize.prompts import TokenizedPrompts


@dataclass(frozen=True)
class BackendConfig:
    """The settings a backend runs with: four sections of the job, and the names of the
    per-row input columns that change what it runs (no input, output, cluster or storage)."""

    model: ModelConfig
    sampling: SamplingConfig
    scheduler: SchedulerConfig
    engine: EngineConfig
    labels_column: str | None  # input.labels_column: rows carry their own labels
    json_schema_column: str | None  # input.json_schema_column: per-row JSON schemas
    regex_column: str | None  # input.regex_column: per-row regexes
    choice_column: str | None  # input.choice_column: per-row choice lists
    # output.reasoning_parser: a constrained row's grammar starts after its reasoning
    reasoning_parser: str | None = OutputConfig.reasoning_parser

    @property
    def guided(self) -> bool:
        """Whether any row's output may be constrained (a JSON schema, regex or choices)."""
        s = self.sampling
        job = s.json_schema is not None or s.regex is not None or bool(s.choice)
        return job or bool(self.json_schema_column or self.regex_column or self.choice_column)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of a request's generated tokens (``sampling.logprobs = N``): float32
    log-softmax of the raw logits (before temperature, top-k, top-p), as vLLM by default."""

    logprob: np.ndarray  # float32 [T]: of each generated token
    top_ids: np.ndarray  # int32 [T, N]: the N most likely tokens at each step, best first
    top_logprobs: np.ndarray  # float32 [T, N]


@dataclass(frozen=True)
class FinishedRequest:
    """One finished request. The optional fields are set only when the job asks for them."""

    position: int  # index in TokenizedPrompts
    row_id: int
    token_ids: np.ndarray  # int32 generated tokens (stop token included, as HF does)
    finish_reason: str  # "stop" | "length" | "score" | "embed" (the last two generate nothing)
    text: str | None  # set when a stop string cut the text; else the caller detokenizes
    logprobs: TokenLogprobs | None = None  # sampling.logprobs: aligned with token_ids
    # sampling.prompt_logprobs: aligned with the prompt's tokens (entry 0: NaN, it has none)
    prompt_logprobs: TokenLogprobs | None = None
    label_logprobs: np.ndarray | None = None  # float32 [L]: scoring mode, one per label
    label: str | None = None  # scoring mode: the most likely label
    embedding: np.ndarray | None = None  # float32 [D]: model.task = "embed" (nothing generated)
    target_logprobs: np.ndarray | None = None  # float32: engine-internal scoring targets
    status: str | None = None  # None: "ok"; else a per-row status (e.g. "json_incomplete")
    message: str | None = None  # why, for a status other than "ok"


@dataclass(frozen=True)
class IterationRecord:
    """One engine iteration (one forward pass), for the report and the timeline plot."""

    iteration: int
    decode_tokens: int
    prefill_tokens: int
    num_seqs: int
    kv_blocks_used: int
    kv_bytes_used: int
    preempted: int
    wall_s: float


@dataclass(frozen=True)
class BackendRun:
    """What a run did, in terms every backend can report."""

    iterations: list[IterationRecord]
    computed_prefill_tokens: int  # prompt/prefix tokens computed, recomputation included
    recomputed_tokens: int  # tokens computed again after a preemption
    preemptions: int
    peak_kv_bytes: int
    kv_budget_bytes: int
    wall_s: float  # the run's wall time, first-use kernel calibrations excluded
    calibration_s: float = 0.0  # those calibrations (native: attention classes met in the run)


OnFinish = Callable[[FinishedRequest], None]
OnIteration = Callable[[IterationRecord], None]
Detokenize = Callable[[list[int]], str]


@dataclass(frozen=True)
class RunSink:
    """Where a run's output goes: every finished request, and every iteration's record."""

    on_finish: OnFinish
    on_iteration: OnIteration | None = None


class Backend(abc.ABC):
    """An engine that executes a plan. Open one with ``batchjob.backends.open_backend``.

    The pipeline calls, in order: ``rows_over_budget`` (those rows get status
    ``kv_budget_exceeded``), ``check_fits`` on the rest, ``run``; ``close`` once at the end
    (one backend may run several plans: ``batchjob.Generator``)."""

    name: str  # engine.backend
    device: str  # where it runs, for the report ("cpu", "cuda:0", ...)

    @abc.abstractmethod
    def rows_over_budget(self, prompts: TokenizedPrompts, plan: Plan) -> np.ndarray:
        """bool [N]: the requests that cannot fit the backend's KV budget even alone (prompt +
        max_tokens, in the backend's own blocks). The pipeline reports those rows as
        ``kv_budget_exceeded`` and runs the rest (every row over: ``check_fits`` raises)."""

    @abc.abstractmethod
    def check_fits(self, prompts: TokenizedPrompts, plan: Plan) -> None:
        """Raise ``ConfigError`` naming the row when a request cannot fit the KV budget."""

    @abc.abstractmethod
    def run(self, prompts: TokenizedPrompts, plan: Plan, sink: RunSink) -> BackendRun:
        """Execute ``plan``: every finished request to ``sink.on_finish`` as it finishes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the model and the KV cache (the backend runs no more plans)."""
