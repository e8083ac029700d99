"""The job file's sections, one frozen dataclass each: one declaration, one default and one
check per setting. The sections go to the layers that use them (the native engine, its
scheduler and sampler take ``SchedulerConfig``, ``EngineConfig`` and ``SamplingConfig``), so
every value a lower layer would refuse is refused here, at load time, before any work.
Torch-free: names come from ``batchjob.backends.names``."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.backends.names import (
    ATTENTION_BACKENDS,
    BACKENDS,
    LINEAR_BACKENDS,
    POOLING_METHODS,
    SCHEDULING_POLICIES,
    TASKS,
)
from batchjob.backends.reasoning import REASONING_PARSERS
from batchjob.config.checks import (
    _bool,
    _fail,
    _float,
    _int,
    _list,
    _path,
    _str,
    parse_bytes,
)
from batchjob.config.guided import check_choices, check_regex
from batchjob.config.json_schema import XGRAMMAR_HINT, compact_json_schema
from batchjob.config.per_row import BY_COLUMN, REQUEST_COLUMNS, ROW_SETTING_COLUMNS, ROW_SETTINGS
from batchjob.config.per_row import MAX_SAMPLES as MAX_SAMPLES
from batchjob.config.per_row import MAX_TOKENS as MAX_TOKENS
from batchjob.errors import ConfigError
from batchjob.model.hub import model_folder
from batchjob.storage.settings import StorageConfig as StorageConfig
from batchjob.storage.stores import ObjectPath, is_uri


def _prompt_source_checks(cfg: Any) -> None:
    """input.template / messages_column / system_prompt: types, one source, a valid template."""
    _str("input.messages_column", cfg.messages_column, optional=True)
    if cfg.system_prompt is not None and not isinstance(cfg.system_prompt, str):
        _fail("input.system_prompt", "must be a string", cfg.system_prompt)
    if cfg.template is None:
        return
    _str("input.template", cfg.template)
    if cfg.messages_column is not None:
        _fail("input.template", "cannot be combined with input.messages_column", cfg.template)
    from batchjob.inputs.template import parse_template  # torch-free, no import cycle

    try:
        parse_template(cfg.template)
    except ValueError as e:
        raise ConfigError(f"input.template: {e}") from None


def _adapter_checks(cfg: Any) -> None:
    """model.adapters: a table of name = folder, each holding a PEFT LoRA adapter;
    model.adapter: one of its names."""
    if not isinstance(cfg.adapters, dict):
        _fail("model.adapters", "must be a table of name = adapter folder", cfg.adapters)
    folders = {}
    for name, folder in cfg.adapters.items():
        key = f"model.adapters.{name}"
        if not isinstance(folder, str | Path) or not str(folder).strip():
            _fail(key, "must be a folder (adapter_config.json, adapter_model.safetensors)", folder)
        path = Path(folder).expanduser()
        for need in ("adapter_config.json", "adapter_model.safetensors"):
            if not (path / need).is_file():
                _fail(key, f"{path} has no {need} (a PEFT LoRA adapter folder)", str(folder))
        folders[str(name)] = path
    object.__setattr__(cfg, "adapters", folders)
    _str("model.adapter", cfg.adapter, optional=True)
    if cfg.adapter is not None and cfg.adapter not in folders:
        names = ", ".join(folders) or "none"
        _fail("model.adapter", f"must name one of model.adapters ({names})", cfg.adapter)


# ---------------------------------------------------------------------------------------
# sections


_KINDS = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "a table"}


@dataclass(frozen=True)
class InputConfig:
    path: str  # a Parquet file, folder or glob, an OpenAI Batch .jsonl, or an s3:// URI
    prompt_column: str = "prompt"  # text, or list<int> token ids (detected from the type)
    id_column: str | None = None  # an id column checked to exist (OpenAI output: custom_id)
    max_tokens_column: str | None = "max_tokens"  # per-row output limit, used when present
    batch_rows: int = 65536  # rows per streamed Arrow batch
    limit: int | None = None  # read only the first N rows
    template: str | None = None  # build prompts from columns: "Q: {question}" ({{ }}: braces)
    messages_column: str | None = None  # chat messages: list<struct<role, content>>
    system_prompt: str | None = None  # a system turn put before each row's messages/prompt
    # per-row settings, one column each (batchjob.config.per_row.ROW_SETTINGS: their types,
    # bounds, statuses and meanings); a null value takes the [sampling] one
    temperature_column: str | None = None
    top_p_column: str | None = None
    top_k_column: str | None = None
    seed_column: str | None = None
    stop_column: str | None = None
    min_p_column: str | None = None
    presence_penalty_column: str | None = None
    frequency_penalty_column: str | None = None
    repetition_penalty_column: str | None = None
    min_tokens_column: str | None = None
    logit_bias_column: str | None = None
    allowed_token_ids_column: str | None = None
    labels_column: str | None = None
    json_schema_column: str | None = None
    regex_column: str | None = None
    choice_column: str | None = None
    n_column: str | None = None
    adapter_column: str | None = None  # the name of each row's LoRA adapter (model.adapters)

    def __post_init__(self) -> None:
        if self.path is not None and not isinstance(self.path, str | Path):  # TOML path = 5
            _fail(
                "input.path",
                "must be a string (a Parquet file, folder, glob or URI), not "
                + _KINDS.get(type(self.path), type(self.path).__name__),
                self.path,
            )
        _str("input.path", self.path if self.path is None else str(self.path))
        object.__setattr__(self, "path", str(self.path))
        _str("input.prompt_column", self.prompt_column)
        _str("input.id_column", self.id_column, optional=True)
        _str("input.max_tokens_column", self.max_tokens_column, optional=True)
        _int("input.batch_rows", self.batch_rows, lo=1)
        _int("input.limit", self.limit, lo=1, optional=True)
        _prompt_source_checks(self)
        _str("input.adapter_column", self.adapter_column, optional=True)
        for name in ROW_SETTING_COLUMNS:
            _str(f"input.{name}", getattr(self, name), optional=True)
        if self.path.endswith(".jsonl"):  # OpenAI Batch requests: each sets its own row's
            for name, column in REQUEST_COLUMNS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, column)


# the per-row settings' columns, as ROW_SETTINGS declares them (a test checks InputConfig
# declares the same, in the same order)
_DECLARED = tuple(f.name for f in dataclasses.fields(InputConfig) if f.name in BY_COLUMN)
assert _DECLARED == ROW_SETTING_COLUMNS, (_DECLARED, ROW_SETTING_COLUMNS)


@dataclass(frozen=True)
class ModelConfig:
    # a local Hugging Face folder, or a Hub id "org/name" (its snapshot in the Hub cache;
    # downloaded unless HF_HUB_OFFLINE=1); a local folder of that name wins (required to run)
    path: Path | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit; unset: main
    tokenizer: Path | None = None  # the tokenizer's folder or Hub id (at main); unset: path's
    dtype: str = "auto"  # weights and compute; auto: by checkpoint and device
    device: str = "auto"  # auto (CUDA when present), cpu, cuda or cuda:N
    max_model_len: int | None = None  # context length; unset: max_position_embeddings
    chat_template: str | None = None  # auto (the folder's), none, or a Jinja file
    # vllm: its quantization method (awq, gptq, fp8, ...); unset: what config.json declares
    quantization: str | None = None
    # auto: generation_config.json's temperature, top_p, top_k, min_p, penalties and
    # max_new_tokens for the [sampling] keys the job leaves unset (vLLM's default); none: off
    generation_config: str = "auto"
    # generate: generate text; embed: an embedding column per row (the final hidden states
    # pooled), nothing generated
    task: str = "generate"
    # embed: last (token), mean (over every prompt token) or cls (the first token); auto: the
    # folder's sentence-transformers 1_Pooling/config.json, else last (vLLM's default)
    pooling: str = "auto"
    # embed: scale each embedding to unit L2 norm; unset: true when the folder's modules.json
    # has a Normalize module or no modules.json is there (vLLM's default), else false
    normalize: bool | None = None
    # embed: keep the first N dimensions, then normalize (Matryoshka: config.json declares
    # is_matryoshka or matryoshka_dimensions, as vLLM asks); unset: all
    dimensions: int | None = None

    # LoRA adapters in PEFT's format, name = folder (adapter_config.json and
    # adapter_model.safetensors); rows pick one by input.adapter_column or model.adapter
    adapters: dict[str, Path] = field(default_factory=dict)
    adapter: str | None = None  # the adapter of rows that name none; unset: the base model

    def __post_init__(self) -> None:
        _str("model.revision", self.revision, optional=True)
        _adapter_checks(self)
        _str("model.task", self.task, TASKS)
        _str("model.pooling", self.pooling, POOLING_METHODS)
        if self.normalize is not None:
            _bool("model.normalize", self.normalize)
        _int("model.dimensions", self.dimensions, lo=1, optional=True)
        _str("model.quantization", self.quantization, optional=True)
        _str("model.generation_config", self.generation_config, ("auto", "none"))
        _path(self, "path", "model.path", optional=True)
        _path(self, "tokenizer", "model.tokenizer", optional=True)
        _str("model.dtype", self.dtype, ("auto", "float32", "float16", "bfloat16"))
        _str("model.device", self.device)
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            _fail("model.device", "must be auto, cpu, cuda or cuda:N", self.device)
        _int("model.max_model_len", self.max_model_len, lo=2, optional=True)
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", str(self.chat_template))
        _str("model.chat_template", self.chat_template, optional=True)
        if is_uri(self.chat_template):
            _fail("model.chat_template", "must be auto, none or a local file", self.chat_template)

    def with_hub_snapshots(self) -> ModelConfig:
        """This section with Hub ids (``path``, ``tokenizer``) replaced by their snapshot
        folders (``model.hub``: the cache, else a download where allowed; ModelError when
        neither). Called once every section is checked, so a bad setting is named before the
        network or the cache is asked anything."""

        def snapshot(value: Path | None, key: str, revision: str | None) -> Path | None:
            if value is None or not str(value).strip() or is_uri(str(value)):
                return value
            return model_folder(str(value), key, revision)

        path = snapshot(self.path, "model.path", self.revision)
        tokenizer = snapshot(self.tokenizer, "model.tokenizer", None)
        if (path, tokenizer) == (self.path, self.tokenizer):
            return self
        return dataclasses.replace(self, path=path, tokenizer=tokenizer)

    @property
    def tokenizer_path(self) -> Path | None:
        """Where the tokenizer files (and the chat template) are: model.tokenizer, else
        model.path."""
        return self.tokenizer if self.tokenizer is not None else self.path


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn and when a request stops; the native sampler takes it as is
    (per row, ``dataclasses.replace(cfg, max_tokens=row_limit)``)."""

    max_tokens: int = 128  # output limit where the row has none (finish "length")
    n: int = 1  # samples per prompt, one result row each (sample_index); they share the prompt
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 (-1 as vLLM, or >= vocab size): off
    top_p: float = 1.0  # keep the smallest set with probability >= top_p; 1: off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0: off
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # x a token's count in the output so far, off its logit
    repetition_penalty: float = 1.0  # tokens of prompt or output: logit / p if > 0, else x p
    min_tokens: int = 0  # EOS and stop ids masked, stop strings ignored, until N tokens
    # added to these tokens' logits ({50256 = -100}), each clamped to [-100, 100]
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] = ()  # only these ids can be generated; []: any
    seed: int = 0  # each draw hashes (seed, row_id, step): same seed, same outputs
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end a row (finish "stop") besides EOS
    stop: tuple[str, ...] = ()  # stop strings (finish "stop"); the text is cut before one
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    # words never generated: each one's last token banned where the output ends with the rest
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True  # output_text without special tokens (BOS, EOS, ...)
    # kept (skip_special_tokens = false): two in a row with no space between when false
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None  # per generated token: its log-prob and the top N (N <= 20)
    prompt_logprobs: int | None = None  # per prompt token: its log-prob and the top N (N <= 20)
    labels: tuple[str, ...] = ()  # scoring mode: each label's log-prob, nothing generated
    json_schema: str | None = None  # constrain output: a schema file, inline JSON "{...}", a table
    regex: str | None = None  # constrain output to match this regex
    choice: tuple[str, ...] = ()  # constrain output to one of these strings

    def __post_init__(self) -> None:
        _int("sampling.max_tokens", self.max_tokens, lo=1, hi=MAX_TOKENS)
        for st in ROW_SETTINGS:  # the bounds of the per-row settings (the rows' own, too)
            if st.kind == "number":
                lo, hi = st.bounds()
                v = getattr(self, st.name)
                number = isinstance(v, int | float) and not isinstance(v, bool)
                if st.invalid is not None and number and not lo < v < math.inf:
                    _fail(st.key, st.invalid, v)  # repetition_penalty: "> 0 and finite"
                _float(self, st.name, st.key, lo, hi, lo_open=st.lo_open)
            elif st.kind == "integer":
                assert st.lo is not None and st.hi is not None, st.name
                v = getattr(self, st.name)
                if st.off is not None and v == st.off and not isinstance(v, bool):
                    object.__setattr__(self, st.name, int(st.lo))  # vLLM's top_k = -1: off
                _int(st.key, getattr(self, st.name), lo=int(st.lo), hi=int(st.hi))
        object.__setattr__(self, "logit_bias", logit_bias_table(self.logit_bias))
        _list(self, "allowed_token_ids", "sampling.allowed_token_ids", int)
        if any(t < 0 for t in self.allowed_token_ids):
            _fail("sampling.allowed_token_ids", "must be >= 0", list(self.allowed_token_ids))
        _list(self, "stop_token_ids", "sampling.stop_token_ids", int)
        if any(t < 0 for t in self.stop_token_ids):
            _fail("sampling.stop_token_ids", "must be >= 0", list(self.stop_token_ids))
        _list(self, "stop", "sampling.stop", str)
        if not all(self.stop):
            _fail("sampling.stop", "stop strings must be non-empty", list(self.stop))
        _bool("sampling.ignore_eos", self.ignore_eos)
        _bool("sampling.include_stop_str_in_output", self.include_stop_str_in_output)
        _list(self, "bad_words", "sampling.bad_words", str)
        if not all(w.strip() for w in self.bad_words):
            _fail("sampling.bad_words", "bad words must be non-empty", list(self.bad_words))
        _bool("sampling.skip_special_tokens", self.skip_special_tokens)
        _bool("sampling.spaces_between_special_tokens", self.spaces_between_special_tokens)
        _int("sampling.logprobs", self.logprobs, lo=0, optional=True)
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            _fail("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        _int("sampling.prompt_logprobs", self.prompt_logprobs, lo=0, optional=True)
        if self.prompt_logprobs is not None and self.prompt_logprobs > MAX_LOGPROBS:
            _fail(
                "sampling.prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.prompt_logprobs
            )
        if self.labels and self.prompt_logprobs is not None:
            _fail(
                "sampling.prompt_logprobs",
                "cannot be combined with sampling.labels",
                self.prompt_logprobs,
            )
        _list(self, "labels", "sampling.labels", str)
        if not all(self.labels) or len(set(self.labels)) != len(self.labels):
            _fail("sampling.labels", "labels must be non-empty and distinct", list(self.labels))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _json_schema(self.json_schema))
        if self.regex is not None:
            _str("sampling.regex", self.regex)
            _guided("sampling.regex", check_regex, self.regex)
        _list(self, "choice", "sampling.choice", str)
        if self.choice:
            _guided("sampling.choice", check_choices, self.choice)
        guides = [k for k in ("json_schema", "regex", "choice") if getattr(self, k)]
        if len(guides) > 1:
            key, other = guides[1], guides[0]
            _fail(
                f"sampling.{key}", f"cannot be combined with sampling.{other}", getattr(self, key)
            )
        if guides and self.labels:
            key = f"sampling.{guides[0]}"
            _fail(key, "cannot be combined with sampling.labels", list(self.labels))
        if self.labels and self.bad_words:
            _fail("sampling.bad_words", "cannot be combined with sampling.labels", self.labels)
        if self.labels and self.n != 1:
            _fail("sampling.n", "must be 1 with sampling.labels (scoring draws nothing)", self.n)
        if self.labels and (changed := self.processors()):
            key = f"sampling.{changed[0]}"
            _fail(key, "cannot be combined with sampling.labels (raw log-probs)", list(self.labels))

    def __hash__(self) -> int:  # logit_bias is a dict: hashed as its sorted items
        return hash(
            tuple(
                tuple(sorted(v.items())) if isinstance(v, dict) else v
                for v in (getattr(self, f.name) for f in dataclasses.fields(self))
            )
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def processors(self) -> list[str]:
        """The logits processors this setting turns on (penalties, bias, masks, min_p: the
        ``processor`` settings of ``ROW_SETTINGS`` off their defaults), by key name; [] for
        the defaults."""
        return [
            st.name
            for st in ROW_SETTINGS
            if st.processor and getattr(self, st.name) != _SAMPLING_DEFAULTS[st.name]
        ]


_SAMPLING_DEFAULTS = {
    f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    for f in dataclasses.fields(SamplingConfig)
}


LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100]; so does batchjob


def logit_bias_table(v: Any, key: str = "sampling.logit_bias") -> dict[int, float]:
    """A token id -> bias table (TOML keys are strings: ``{"50256" = -100}``) as {int: float},
    each bias clamped to [-100, 100]; ConfigError naming ``key`` for a bad id or bias."""
    if not isinstance(v, dict | list | tuple):
        raise ConfigError(f"{key}: must be a table of token id = bias, got {v!r}")
    items = v.items() if isinstance(v, dict) else v
    out: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            _fail(key, "must be a table of token id = bias", v)
        tok, bias = item
        if isinstance(tok, str) and tok.strip().isdigit():
            tok = int(tok)
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            _fail(key, "token ids must be integers >= 0", tok)
        if not isinstance(bias, int | float) or isinstance(bias, bool) or not math.isfinite(bias):
            _fail(key, f"token {tok}: the bias must be a finite number", bias)
        out[tok] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    return out


def _guided(key: str, check: Any, value: Any) -> None:
    try:
        check(value)
    except ImportError:
        raise ConfigError(f"{key}: {XGRAMMAR_HINT}, got {value!r}") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {e}, got {value!r}") from None


def _json_schema(v: Any) -> str:
    """Inline JSON (starts with "{"), a schema file, or the schema as a table (a dict, as
    vLLM's ``StructuredOutputsParams(json=...)`` takes it) -> the schema as compact JSON
    text, checked to be a JSON Schema that xgrammar can compile (else ConfigError naming the
    key)."""
    key = "sampling.json_schema"
    if isinstance(v, dict):
        v = json.dumps(v)
    _str(key, v)
    text = v
    if not v.lstrip().startswith("{"):
        try:
            text = Path(v).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            _fail(key, f"not inline JSON and not a readable file ({e.__class__.__name__})", v)
    try:
        return compact_json_schema(text)
    except ImportError:
        raise ConfigError(f"{key}: {XGRAMMAR_HINT}, got {v!r}") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {e}, got {v!r}") from None


BASELINE_MAX_NUM_SEQS = 256  # scheduler.max_num_seqs unset on the baseline policy
KV_THRESHOLD_NATIVE = 0.95  # scheduler.kv_threshold unset, by backend (kv_threshold_for)
KV_THRESHOLD_VLLM = 1.0


@dataclass(frozen=True)
class SchedulerConfig:
    """The native scheduler's settings; it takes this section as is, with the engine's
    ``KVLayout`` (block count and size) beside it."""

    policy: str = "batchllm"  # batchllm: groups, KV admission; baseline: vLLM v1-like
    chunk_size: int | None = None  # tokens per iteration; unset: 2048 native, vLLM's default
    # KV fraction above which no new prefill is admitted; unset: 0.95 native, 1.0 vllm
    kv_threshold: float | None = None
    # running-request cap, both policies; unset: 256 baseline, none batchllm (KV admits)
    max_num_seqs: int | None = None
    enlarge: bool = True  # first-level enlargement of the plan's groups (Algo 1)
    reorder: bool = True  # order groups by decode/prefill ratio (Eq. 4)
    decode_reserve: bool = True  # batchllm: admit prefill against the projected decode peak
    # planning memory: a larger dataset is planned and run in partitions; unset: half of RAM
    plan_memory: int | None = None

    def __post_init__(self) -> None:
        _str("scheduler.policy", self.policy, SCHEDULING_POLICIES)
        _int("scheduler.chunk_size", self.chunk_size, lo=1, optional=True)
        if self.kv_threshold is not None:
            _float(self, "kv_threshold", "scheduler.kv_threshold", 0.0, 1.0, lo_open=True)
        _int("scheduler.max_num_seqs", self.max_num_seqs, lo=1, optional=True)
        _bool("scheduler.enlarge", self.enlarge)
        _bool("scheduler.reorder", self.reorder)
        _bool("scheduler.decode_reserve", self.decode_reserve)
        if self.plan_memory is not None:
            try:
                object.__setattr__(self, "plan_memory", parse_bytes(self.plan_memory))
            except ValueError as e:
                raise ConfigError(f"scheduler.plan_memory: {e}") from None
            _int("scheduler.plan_memory", self.plan_memory, lo=1)

    @property
    def running_cap(self) -> int | None:
        """The most requests running at once: the job's ``max_num_seqs``, else 256 on the
        baseline policy (vLLM's default) and none on batchllm (KV memory admits)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return BASELINE_MAX_NUM_SEQS if self.policy == "baseline" else None

    def kv_threshold_for(self, backend: str) -> float:
        """The admission threshold ``backend`` runs: the job's, else that backend's default.
        The native scheduler keeps the paper's M_threshold margin below its block count. The
        vllm backend's scheduler class admits against a projected peak counted in vLLM's own
        blocks, and vLLM preempts on any overrun, so a margin there only idles KV: 1.0."""
        if self.kv_threshold is not None:
            return self.kv_threshold
        return KV_THRESHOLD_VLLM if backend == "vllm" else KV_THRESHOLD_NATIVE

    def kv_cap_blocks(self, num_blocks: int) -> int:
        """The native scheduler's M_threshold in blocks: floor(threshold * num_blocks)."""
        return math.floor(self.kv_threshold_for("native") * num_blocks + 1e-9)


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs the plan and its KV cache; the native engine takes it as is."""

    backend: str = "native"  # native (batchjob's engine) or vllm
    kv_cache_bytes: int | None = None  # KV cache; unset: gpu_memory_fraction, 2 GiB on CPU
    gpu_memory_fraction: float = 0.9  # GPU memory share for the KV cache (kv_cache_bytes unset)
    block_size: int | None = None  # tokens per KV block; unset: 16 native, vLLM: see backends
    attention: str = "auto"  # auto, torch, cpu (C kernel) or triton (CUDA)
    linear: str = "auto"  # auto: CPU fp32 on the C kernel or packed oneDNN, bf16 packed oneDNN
    threads: int | None = None  # CPU threads; unset: all cores
    # CUDA: batches of up to this many tokens replay CUDA graphs (512: vLLM's default); 0:
    # eager; unset: native eager, vLLM its own
    cuda_graph_max_tokens: int | None = None
    vllm: dict[str, Any] = field(default_factory=dict)  # more vLLM EngineArgs (vllm only)

    def __post_init__(self) -> None:
        _str("engine.backend", self.backend, BACKENDS)
        if not isinstance(self.vllm, dict):
            _fail("engine.vllm", "must be a table of vLLM engine arguments", self.vllm)
        if self.vllm and self.backend != "vllm":
            _fail("engine.vllm", 'is for engine.backend = "vllm"', self.vllm)
        if self.kv_cache_bytes is not None:
            try:
                object.__setattr__(self, "kv_cache_bytes", parse_bytes(self.kv_cache_bytes))
            except ValueError as e:
                raise ConfigError(f"engine.kv_cache_bytes: {e}") from None
            _int("engine.kv_cache_bytes", self.kv_cache_bytes, lo=1)
        _float(self, "gpu_memory_fraction", "engine.gpu_memory_fraction", 0.0, 1.0, lo_open=True)
        _int("engine.block_size", self.block_size, lo=1, optional=True)
        _str("engine.attention", self.attention, ATTENTION_BACKENDS)
        _str("engine.linear", self.linear, LINEAR_BACKENDS)
        _int("engine.threads", self.threads, lo=1, optional=True)
        _int("engine.cuda_graph_max_tokens", self.cuda_graph_max_tokens, lo=0, optional=True)


@dataclass(frozen=True)
class OutputConfig:
    path: Path | ObjectPath  # results: a .parquet file, else a folder of results files
    report_path: Path | ObjectPath | None = None  # throughput report; unset: <meta>/report.json
    plan_path: Path | ObjectPath | None = None  # the plan; unset: <meta>/plan.parquet
    overwrite: bool = False  # replace another job's results at this path
    rows_per_file: int = 100000  # rows per results file of a folder output
    flush_rows: int = 4096  # finished rows per atomic part file (what a crash can lose)
    format: str = "parquet"  # openai-jsonl: also write OpenAI Batch output lines
    # a results folder holding files batchjob did not write: refused unless true; then the
    # results go beside them (never deleted) and commit in place, as on an object store
    allow_other_files: bool = False
    # a reasoning model's <think>...</think> part to reasoning_text, only the answer left in
    # output_text (the grammar of json_schema, regex, choice starts after it), as vLLM's
    # reasoning parser of this name splits it; unset: output_text holds all of it
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        _str("output.reasoning_parser", self.reasoning_parser, REASONING_PARSERS, optional=True)
        _path(self, "path", "output.path", optional=False, uri=True)
        _path(self, "report_path", "output.report_path", optional=True, uri=True)
        _path(self, "plan_path", "output.plan_path", optional=True, uri=True)
        _bool("output.overwrite", self.overwrite)
        _bool("output.allow_other_files", self.allow_other_files)
        _int("output.rows_per_file", self.rows_per_file, lo=1)
        _int("output.flush_rows", self.flush_rows, lo=1)
        _str("output.format", self.format, ("parquet", "openai-jsonl"))


_RAY_ADDRESS = re.compile(r"none|local|auto|ray://\S+|[A-Za-z0-9_.\-]+:[0-9]+")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the plan runs: in this process ("none"), or split over the workers of a Ray
    cluster (``batchjob.runner.cluster``; Ray is imported only then)."""

    address: str = "none"  # none, local (start one), auto (this node's), ray://host:port
    workers: int = 1  # engine actors; the plan is split into this many shards, groups whole
    num_cpus: float = 1.0  # Ray CPUs reserved by each worker
    num_gpus: float = 0.0  # Ray GPUs reserved by each worker (1: one engine per GPU)
    max_restarts: int = 1  # per worker: replacements after it dies (0: others take its rows)

    def __post_init__(self) -> None:
        _str("cluster.address", self.address)
        if not _RAY_ADDRESS.fullmatch(self.address):
            _fail(
                "cluster.address",
                "must be none, local, auto, ray://HOST:PORT or HOST:PORT",
                self.address,
            )
        _int("cluster.workers", self.workers, lo=1)
        _float(self, "num_cpus", "cluster.num_cpus", 0.0, 1e6, lo_open=True)
        _float(self, "num_gpus", "cluster.num_gpus", 0.0, 1e6)
        _int("cluster.max_restarts", self.max_restarts, lo=0)
        if self.address != "none" and importlib.util.find_spec("ray") is None:
            _fail("cluster.address", "needs Ray: pip install 'batchjob[ray]'", self.address)
