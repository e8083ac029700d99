"""A whole job: the sections together, and the checks that span sections.

Only what needs the whole job takes a ``JobConfig`` (the CLI, the pipeline, the manifest that
fingerprints it); each stage below takes the sections it uses."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.config.checks import _fail
from batchjob.config.embedding import check_embedding
from batchjob.config.json_schema import XGRAMMAR_HINT
from batchjob.config.per_row import GUIDE_COLUMNS, PROCESSOR_COLUMNS
from batchjob.config.sections import (
    ClusterConfig,
    EngineConfig,
    InputConfig,
    ModelConfig,
    OutputConfig,
    SamplingConfig,
    SchedulerConfig,
    StorageConfig,
)
from batchjob.errors import ConfigError
from batchjob.storage.stores import ObjectPath, is_uri

SECTIONS: dict[str, type] = {
    "input": InputConfig,
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "scheduler": SchedulerConfig,
    "engine": EngineConfig,
    "output": OutputConfig,
    "cluster": ClusterConfig,
    "storage": StorageConfig,
}


@dataclass(frozen=True)
class JobConfig:
    input: InputConfig
    output: OutputConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    source: Path | None = None  # the TOML file it came from

    def __post_init__(self) -> None:
        self._check_storage()
        if self.model.chat_template == "none" and (
            self.input.messages_column or self.input.system_prompt is not None
        ):
            key = "input.messages_column" if self.input.messages_column else "input.system_prompt"
            _fail("model.chat_template", f"'none' cannot render chat turns ({key} is set)", "none")
        self._check_sampling()
        adapters, column = self.model.adapters, self.input.adapter_column
        if column is not None and not adapters:
            _fail("input.adapter_column", "needs model.adapters (name = adapter folder)", column)
        if (adapters or column) and (self.sampling.labels or self.input.labels_column):
            key = "input.adapter_column" if column else "model.adapters"
            labels = "input.labels_column" if self.input.labels_column else "sampling.labels"
            why = f"cannot be combined with {labels} (scoring runs the base model only)"
            _fail(key, why, column or list(adapters))
        if (adapters or column) and self.model.task != "generate":
            key = "input.adapter_column" if column else "model.adapters"
            why = 'is for model.task = "generate" (model.task = "embed" runs the base model only)'
            _fail(key, why, column or list(adapters))
        parser = self.output.reasoning_parser
        if parser and (self.sampling.labels or self.input.labels_column):
            _fail("output.reasoning_parser", "cannot be combined with scoring (labels)", parser)
        if parser and self.model.task != "generate":
            _fail("output.reasoning_parser", 'is for model.task = "generate"', parser)
        check_embedding(self.model, self.sampling, self.input, self.output)
        if self.model.quantization is not None and self.engine.backend != "vllm":
            why = 'is for engine.backend = "vllm" (the native engine runs full-precision weights)'
            _fail("model.quantization", why, self.model.quantization)
        # checks across sections that need no device: the rest wait for the backend to open
        dev, attn = self.model.device, self.engine.attention
        if self.engine.backend != "native":
            return
        if attn == "cpu" and dev.startswith("cuda"):
            _fail("engine.attention", f"'cpu' runs on the CPU only (model.device is {dev})", attn)
        if attn == "triton" and dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            _fail("engine.attention", "'triton' needs CUDA (model.device is cpu)", attn)

    def _check_sampling(self) -> None:
        """[sampling] against the per-row columns and the engine: constraints and logits
        processors are for generation, not scoring; what vLLM refuses with speculative
        decoding. (min_tokens above a row's max_tokens is no error: the row simply cannot stop
        before max_tokens; vLLM gets min(min_tokens, max_tokens).)"""
        s, inp = self.sampling, self.input
        scoring = bool(s.labels or inp.labels_column)
        for name in (*GUIDE_COLUMNS, *PROCESSOR_COLUMNS):
            col = getattr(inp, name)
            if col and scoring:
                _fail(f"input.{name}", "cannot be combined with scoring (labels)", col)
            if col and name in GUIDE_COLUMNS and importlib.util.find_spec("xgrammar") is None:
                _fail(f"input.{name}", XGRAMMAR_HINT, col)
        if scoring and inp.n_column:
            _fail("input.n_column", "cannot be combined with scoring (labels)", inp.n_column)
        if inp.labels_column and s.prompt_logprobs is not None:
            why = "cannot be combined with scoring (input.labels_column)"
            _fail("sampling.prompt_logprobs", why, s.prompt_logprobs)
        native = self.engine.backend == "native"
        if s.prompt_logprobs is not None and native and self.scheduler.policy != "batchllm":
            why = "on the native engine needs scheduler.policy = batchllm (the baseline reuses "
            _fail("sampling.prompt_logprobs", why + "cached KV it never reads)", s.prompt_logprobs)
        if inp.labels_column and s.n != 1:
            _fail("sampling.n", "must be 1 with input.labels_column (scoring draws nothing)", s.n)
        if inp.labels_column and (changed := s.processors()):
            key = f"sampling.{changed[0]}"
            _fail(key, "cannot be combined with scoring (input.labels_column)", inp.labels_column)
        spec = (self.engine.vllm or {}).get("speculative_config")
        if self.engine.backend == "vllm" and spec:  # vLLM: SamplingParams._validate_spec_decode
            for key, on in (("min_p", s.min_p > 0), ("logit_bias", bool(s.logit_bias))):
                col = getattr(inp, f"{key}_column")
                if on or col:
                    name = f"input.{key}_column" if col else f"sampling.{key}"
                    why = "vLLM does not take it with engine.vllm.speculative_config"
                    _fail(name, why, col or getattr(s, key))

    def _check_storage(self) -> None:
        """Every URI path has a filesystem under [storage]; local-only features refuse URIs."""
        from batchjob.storage.stores import check_uri

        out = self.output
        uris: list[tuple[str, object]] = [("input.path", self.input.path)]
        uris += [("output.path", out.path), ("output.report_path", out.report_path)]
        uris += [("output.plan_path", out.plan_path)]
        for key, value in uris:
            if value is None or not is_uri(value):
                continue
            try:
                check_uri(str(value), self.storage)
            except ValueError as e:
                opts = "storage.options" if self.storage.options else key
                raise ConfigError(f"{opts}: {e} (for {key} = {value})") from None
        if is_uri(self.input.path) and self.input.path.endswith(".jsonl"):
            _fail("input.path", "OpenAI JSONL input must be a local file", self.input.path)
        if isinstance(out.path, ObjectPath) and out.format == "openai-jsonl":
            _fail("output.format", "openai-jsonl needs a local output.path", out.format)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON-able dict (paths as strings, tuples as lists), for reports and logs."""

        def plain(v: Any) -> Any:
            if isinstance(v, Path | ObjectPath):
                return str(v)
            if isinstance(v, dict):  # model.adapters: name = folder
                return {k: plain(x) for k, x in v.items()}
            return list(v) if isinstance(v, tuple) else v

        return {
            name: {k: plain(v) for k, v in dataclasses.asdict(getattr(self, name)).items()}
            for name in SECTIONS
        }
