"""Job configuration: a TOML file of six sections, overridable from the command line.

Rules:
- Unknown sections or keys, wrong types and bad values raise ``ConfigError`` naming the
  dotted key and the file (``scheduler.chunk_size``, ``jobs/demo.toml``).
- One declaration, one default and one check per setting: the sections themselves go to the
  layers that use them (the native engine, its scheduler and sampler take ``SchedulerConfig``,
  ``EngineConfig`` and ``SamplingConfig``), so every value a lower layer would refuse is
  refused here, at load time, before any work. Torch-free: names come from
  ``batchjob.backends.names``.
- Relative paths written in the TOML file resolve against the TOML file's directory; paths
  given on the command line (``--set input.path=...``, ``--input``) resolve against the
  current directory, as a shell user expects.
- ``--set section.key=value`` parses ``value`` as a TOML literal (``4096``, ``true``,
  ``[1, 2]``, ``"text"``) and falls back to the raw string (``2GiB``, ``data/x.parquet``).
  For text-valued keys the raw string is always used; ``none`` resets an optional key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchjob.backends.names import (
    ATTENTION_BACKENDS,
    BACKENDS,
    LINEAR_BACKENDS,
    SCHEDULING_POLICIES,
)
from batchjob.errors import ConfigError
from batchjob.json_schema import XGRAMMAR_HINT, compact_json_schema
from batchjob.storage import ObjectPath, is_uri
from batchjob.storage import configure as configure_storage

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """``2GiB`` -> 2147483648; ``1.5GB`` -> 1500000000; ints pass through."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = _SIZE_UNITS.get(m.group(2).lower())
        if unit is not None:
            num = m.group(1)
            return int(num) * unit if num.isdigit() else int(float(num) * unit)
    raise ValueError(f"expected a byte count like 2147483648 or '2GiB', got {value!r}")


# ---------------------------------------------------------------------------------------
# checks used by __post_init__: each raises ConfigError("section.key: ...")


def _fail(key: str, msg: str, value: Any) -> None:
    raise ConfigError(f"{key}: {msg}, got {value!r}")


def _int(key: str, v: Any, lo: int | None = None, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not isinstance(v, int) or isinstance(v, bool):
        _fail(key, "must be an integer", v)
    if lo is not None and v < lo:
        _fail(key, f"must be >= {lo}", v)


def _float(obj: Any, name: str, key: str, lo: float, hi: float, lo_open: bool = False) -> None:
    v = getattr(obj, name)
    if not isinstance(v, int | float) or isinstance(v, bool):
        _fail(key, "must be a number", v)
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        _fail(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}]", v)
    object.__setattr__(obj, name, float(v))  # TOML `1` -> 1.0


def _bool(key: str, v: Any) -> None:
    if not isinstance(v, bool):
        _fail(key, "must be true or false", v)


def _str(key: str, v: Any, choices: tuple[str, ...] = (), optional: bool = False) -> None:
    if v is None and optional:
        return
    if not isinstance(v, str) or not v:
        _fail(key, "must be a non-empty string", v)
    if choices and v not in choices:
        _fail(key, f"must be one of {', '.join(choices)}", v)


def _path(obj: Any, name: str, key: str, optional: bool, uri: bool = False) -> None:
    """A local Path, or with ``uri`` an object-store URI as ``ObjectPath`` (batchjob.storage)."""
    v = getattr(obj, name)
    if v is None:
        if not optional:
            raise ConfigError(f"{key}: required")
        return
    if not isinstance(v, str | Path | ObjectPath) or not str(v):
        _fail(key, "must be a path", v)
    if is_uri(v) and not uri:
        _fail(key, "must be a local path (object-store URIs are for input.path, output.*)", v)
    object.__setattr__(obj, name, ObjectPath(str(v)) if is_uri(v) else Path(v))


def _list(obj: Any, name: str, key: str, item: type) -> None:
    v = getattr(obj, name)
    if not isinstance(v, list | tuple) or not all(
        isinstance(x, item) and not isinstance(x, bool) for x in v
    ):
        _fail(key, f"must be a list of {item.__name__}", v)
    object.__setattr__(obj, name, tuple(v))


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
    from batchjob.prompt_template import parse_template  # torch-free, no import cycle

    try:
        parse_template(cfg.template)
    except ValueError as e:
        raise ConfigError(f"input.template: {e}") from None


# ---------------------------------------------------------------------------------------
# sections


@dataclass(frozen=True)
class InputConfig:
    path: str  # a Parquet file, a directory of them, or a glob (absolute after loading)
    prompt_column: str = "prompt"  # text column, or list<int> token ids (auto-detected)
    id_column: str | None = None  # a pass-through id column checked to exist
    max_tokens_column: str = "max_tokens"  # per-row decode limit, used when present
    batch_rows: int = 65536  # rows per streamed Arrow batch
    limit: int | None = None  # read only the first N rows
    template: str | None = None  # prompt built from columns: "Q: {question}" ({{ }}: braces)
    messages_column: str | None = None  # list<struct<role, content>> chat messages
    system_prompt: str | None = None  # system turn put before each row's messages/prompt
    # per-row settings (batchjob.row_settings): a null value takes the [sampling] one
    temperature_column: str | None = None
    top_p_column: str | None = None
    top_k_column: str | None = None
    seed_column: str | None = None
    stop_column: str | None = None  # list<string>
    labels_column: str | None = None  # list<string>: scoring mode, this row's labels
    json_schema_column: str | None = None  # string: this row's JSON schema (structured output)

    def __post_init__(self) -> None:
        _str("input.path", self.path if self.path is None else str(self.path))
        object.__setattr__(self, "path", str(self.path))
        _str("input.prompt_column", self.prompt_column)
        _str("input.id_column", self.id_column, optional=True)
        _str("input.max_tokens_column", self.max_tokens_column)
        _int("input.batch_rows", self.batch_rows, lo=1)
        _int("input.limit", self.limit, lo=1, optional=True)
        _prompt_source_checks(self)
        for name in ROW_SETTING_COLUMNS:
            _str(f"input.{name}", getattr(self, name), optional=True)


ROW_SETTING_COLUMNS = (
    "temperature_column",
    "top_p_column",
    "top_k_column",
    "seed_column",
    "stop_column",
    "labels_column",
    "json_schema_column",
)


@dataclass(frozen=True)
class ModelConfig:
    path: Path | None = None  # local Hugging Face folder (config.json, safetensors, tokenizer)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # default: config.json max_position_embeddings
    chat_template: str | None = None  # auto | none | PATH; unset: only messages use the model's

    def __post_init__(self) -> None:
        _path(self, "path", "model.path", optional=True)
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


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn and when a request stops; the native sampler takes it as is
    (per row, ``dataclasses.replace(cfg, max_tokens=row_limit)``)."""

    max_tokens: int = 128  # generated tokens at most (finish "length"), where the row has none
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 (or >= vocab size): off
    top_p: float = 1.0  # keep the smallest set with probability >= top_p; 1: off
    seed: int = 0  # each draw is a hash of (seed, row_id, step): same seed, same outputs
    stop_token_ids: tuple[int, ...] = ()  # finish "stop" when one is generated
    stop: tuple[str, ...] = ()  # finish "stop" when the text contains one (text cut before it)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # per generated token: its log-prob and the top-N (0..20)
    labels: tuple[str, ...] = ()  # scoring mode: log-prob of each label after the prompt
    json_schema: str | None = None  # structured output: inline JSON or a schema file path

    def __post_init__(self) -> None:
        _int("sampling.max_tokens", self.max_tokens, lo=1)
        _float(self, "temperature", "sampling.temperature", 0.0, 100.0)
        _int("sampling.top_k", self.top_k, lo=0)
        _float(self, "top_p", "sampling.top_p", 0.0, 1.0, lo_open=True)
        _int("sampling.seed", self.seed, lo=0)
        _list(self, "stop_token_ids", "sampling.stop_token_ids", int)
        if any(t < 0 for t in self.stop_token_ids):
            _fail("sampling.stop_token_ids", "must be >= 0", list(self.stop_token_ids))
        _list(self, "stop", "sampling.stop", str)
        if not all(self.stop):
            _fail("sampling.stop", "stop strings must be non-empty", list(self.stop))
        _bool("sampling.ignore_eos", self.ignore_eos)
        _int("sampling.logprobs", self.logprobs, lo=0, optional=True)
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            _fail("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        _list(self, "labels", "sampling.labels", str)
        if not all(self.labels) or len(set(self.labels)) != len(self.labels):
            _fail("sampling.labels", "labels must be non-empty and distinct", list(self.labels))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _json_schema(self.json_schema))
        if self.json_schema is not None and self.labels:
            _fail("sampling.json_schema", "cannot be combined with sampling.labels", self.labels)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _json_schema(v: Any) -> str:
    """Inline JSON (starts with "{") or a schema file -> the schema as compact JSON text,
    checked to be a JSON Schema that xgrammar can compile (else ConfigError naming the key)."""
    key = "sampling.json_schema"
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


@dataclass(frozen=True)
class SchedulerConfig:
    """The native scheduler's settings; it takes this section as is, with the engine's
    ``KVLayout`` (block count and size) beside it."""

    policy: str = "batchllm"  # batchllm (groups, 3 queues, Algo 2) | baseline (vLLM v1 style)
    chunk_size: int = 2048  # token budget S_chunk per iteration (decode + prefill tokens)
    kv_threshold: float = 0.95  # M_threshold: KV fraction above which no new prefill starts
    max_num_seqs: int = 256  # running-request cap (baseline policy only)
    enlarge: bool = True  # Algo 1 first-level enlargement
    reorder: bool = True  # Eq. 4 group order
    decode_reserve: bool = True  # batchllm: admit new prefill against the projected decode peak

    def __post_init__(self) -> None:
        _str("scheduler.policy", self.policy, SCHEDULING_POLICIES)
        _int("scheduler.chunk_size", self.chunk_size, lo=1)
        _float(self, "kv_threshold", "scheduler.kv_threshold", 0.0, 1.0, lo_open=True)
        _int("scheduler.max_num_seqs", self.max_num_seqs, lo=1)
        _bool("scheduler.enlarge", self.enlarge)
        _bool("scheduler.reorder", self.reorder)
        _bool("scheduler.decode_reserve", self.decode_reserve)

    def kv_cap_blocks(self, num_blocks: int) -> int:
        """M_threshold in blocks: floor(kv_threshold * num_blocks)."""
        return math.floor(self.kv_threshold * num_blocks + 1e-9)


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs the plan and its KV cache; the native engine takes it as is."""

    backend: str = "native"  # native | vllm
    kv_cache_bytes: int | None = None  # None: from gpu_memory_fraction on GPU, 2 GiB on CPU
    gpu_memory_fraction: float = 0.9  # of the GPU's memory, when kv_cache_bytes is None
    block_size: int = 16  # tokens per KV block (any size >= 1: the kernels index by // and %)
    attention: str = "auto"  # auto | torch | cpu (C kernel) | triton (CUDA)
    linear: str = "auto"  # auto: float32 CPU models' batches of <= 2048 rows on the C kernel
    # where the calibration found it faster | torch
    threads: int | None = None  # torch CPU threads
    vllm: dict[str, Any] = field(default_factory=dict)  # extra vLLM engine arguments (vllm only)

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
        _int("engine.block_size", self.block_size, lo=1)
        _str("engine.attention", self.attention, ATTENTION_BACKENDS)
        _str("engine.linear", self.linear, LINEAR_BACKENDS)
        _int("engine.threads", self.threads, lo=1, optional=True)


@dataclass(frozen=True)
class OutputConfig:
    path: Path | ObjectPath  # results: a .parquet file, or a directory (any other name)
    report_path: Path | ObjectPath | None = None  # default: see `report_file`
    plan_path: Path | ObjectPath | None = None  # default: see `plan_file`
    overwrite: bool = False
    rows_per_file: int = 100000
    flush_rows: int = 4096  # finished rows per atomic part file (what a crash can lose)
    format: str = "parquet"  # parquet | openai-jsonl (also writes OpenAI Batch output lines)

    def __post_init__(self) -> None:
        _path(self, "path", "output.path", optional=False, uri=True)
        _path(self, "report_path", "output.report_path", optional=True, uri=True)
        _path(self, "plan_path", "output.plan_path", optional=True, uri=True)
        _bool("output.overwrite", self.overwrite)
        _int("output.rows_per_file", self.rows_per_file, lo=1)
        _int("output.flush_rows", self.flush_rows, lo=1)
        _str("output.format", self.format, ("parquet", "openai-jsonl"))

    @property
    def is_file(self) -> bool:
        """Results go to one file when ``path`` ends in .parquet, else into a directory."""
        return self.path.suffix == ".parquet"

    @property
    def meta_dir(self) -> Path | ObjectPath:
        """Everything but results (plan, report, manifest, unfinished parts, lock) goes to a
        sibling folder: ``out/results.parquet`` -> ``out/results.meta/``; the results folder
        ``out/day1`` -> ``out/day1.meta/`` (so the results folder is a plain dataset)."""
        name = self.path.stem if self.is_file else self.path.name
        return self.path.with_name(name + ".meta")

    @property
    def jsonl_file(self) -> Path | ObjectPath:
        """OpenAI Batch output lines (output.format = "openai-jsonl") beside the results:
        ``out/results.parquet`` -> ``out/results.jsonl``, ``out/day1`` -> ``out/day1.jsonl``."""
        return self.path.with_name((self.path.stem if self.is_file else self.path.name) + ".jsonl")

    @property
    def report_file(self) -> Path | ObjectPath:
        """Default ``<meta_dir>/report.json``."""
        return self.report_path or self.meta_dir / "report.json"

    @property
    def plan_file(self) -> Path | ObjectPath:
        """Default ``<meta_dir>/plan.parquet``."""
        return self.plan_path or self.meta_dir / "plan.parquet"


@dataclass(frozen=True)
class StorageConfig:
    """Object-store access for URI paths (``s3://bucket/prefix``; batchjob.storage). Unset
    values come from the environment: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION /
    AWS_DEFAULT_REGION; credentials always from the AWS chain (AWS_ACCESS_KEY_ID, ...)."""

    endpoint_url: str | None = None  # an S3-compatible server, e.g. http://127.0.0.1:9000
    region: str | None = None
    anonymous: bool = False  # unsigned requests (public buckets)
    options: dict[str, Any] = field(default_factory=dict)  # more pyarrow.fs.S3FileSystem args

    def __post_init__(self) -> None:
        _str("storage.endpoint_url", self.endpoint_url, optional=True)
        if self.endpoint_url is not None and not re.match(r"https?://", self.endpoint_url):
            _fail("storage.endpoint_url", "must start with http:// or https://", self.endpoint_url)
        _str("storage.region", self.region, optional=True)
        _bool("storage.anonymous", self.anonymous)
        if not isinstance(self.options, dict):
            _fail("storage.options", "must be a table of S3FileSystem arguments", self.options)


_RAY_ADDRESS = re.compile(r"none|local|auto|ray://\S+|[A-Za-z0-9_.\-]+:[0-9]+")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the plan runs: in this process ("none"), or split over the workers of a Ray
    cluster (``batchjob.cluster``; Ray is imported only then)."""

    address: str = "none"  # none | local (start one here) | auto (this node's) | ray://host:port
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


_SECTIONS: dict[str, type] = {
    "input": InputConfig,
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "scheduler": SchedulerConfig,
    "engine": EngineConfig,
    "output": OutputConfig,
    "cluster": ClusterConfig,
    "storage": StorageConfig,
}
_PATH_KEYS = {
    "input.path",
    "model.path",
    "output.path",
    "output.report_path",
    "output.plan_path",
    "model.chat_template",  # "auto" and "none" are words, not paths (see _resolve)
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
        col = self.input.json_schema_column
        if col and (self.sampling.labels or self.input.labels_column):
            _fail("input.json_schema_column", "cannot be combined with scoring (labels)", col)
        if col and importlib.util.find_spec("xgrammar") is None:
            _fail("input.json_schema_column", XGRAMMAR_HINT, col)
        # checks across sections that need no device: the rest wait for the backend to open
        dev, attn = self.model.device, self.engine.attention
        if self.engine.backend != "native":
            return
        if attn == "cpu" and dev.startswith("cuda"):
            _fail("engine.attention", f"'cpu' runs on the CPU only (model.device is {dev})", attn)
        if attn == "triton" and dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            _fail("engine.attention", "'triton' needs CUDA (model.device is cpu)", attn)

    def _check_storage(self) -> None:
        """Every URI path has a filesystem under [storage]; local-only features refuse URIs."""
        from batchjob.storage import check_uri

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
            return list(v) if isinstance(v, tuple) else v

        return {
            name: {k: plain(v) for k, v in dataclasses.asdict(getattr(self, name)).items()}
            for name in _SECTIONS
        }


# ---------------------------------------------------------------------------------------
# loading


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["a.b=1", "c.d=x=y"]`` -> ``{"a.b": "1", "c.d": "x=y"}`` (for repeated --set)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out[key.strip()] = value
    return out


def _field_type(section: str, key: str) -> str:
    for f in dataclasses.fields(_SECTIONS[section]):
        if f.name == key:
            return str(f.type)
    return ""


def _parse_value(dotted: str, raw: str) -> Any:
    section, _, key = dotted.partition(".")
    ftype = _field_type(section, key)
    if dotted == "model.chat_template" and raw.strip() in ("auto", "none"):
        return raw.strip()  # words of this key, not "unset"
    if raw.strip().lower() in ("none", "null") and "None" in ftype:
        return None
    if ftype.startswith(("str", "Path")) and not raw.strip().startswith(('"', "'")):
        return raw  # text keys take the raw string: --set input.id_column=2024
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _resolve(value: Any, base: Path) -> Any:
    if value is None or not isinstance(value, str | Path) or value in ("auto", "none"):
        return value
    if is_uri(value):
        return str(value)  # s3://bucket/key: not a local path
    if str(value).startswith("file://"):
        value = str(value)[len("file://") :]
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)  # globs survive normpath


def _check_keys(raw: dict[str, Any], where: str) -> None:
    for section, table in raw.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{where}: unknown section [{section}] (expected one of {', '.join(_SECTIONS)})"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        names = {f.name for f in dataclasses.fields(_SECTIONS[section])}
        for key in table:
            if section == "model" and key == "trust_remote_code":
                raise ConfigError(f"model.trust_remote_code: not supported ({where})")
            if key not in names:
                raise ConfigError(
                    f"{section}.{key}: unknown key in {where} (known: {', '.join(sorted(names))})"
                )


def load_job(
    path: str | Path | None,
    overrides: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
) -> JobConfig:
    """Load a job file and apply ``{"section.key": "value"}`` overrides (strings, as typed).

    ``path`` may be None to build a job from overrides alone.
    """
    cwd = cwd or Path.cwd()
    raw: dict[str, dict[str, Any]] = {}
    where = "command line"
    source = None
    if path is not None:
        source = Path(path).expanduser().resolve()
        where = str(path)
        try:
            raw = tomllib.loads(source.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{where}: job file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: cannot read job file: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{where}: invalid TOML: {e}") from None
        _check_keys(raw, where)
        for dotted in _PATH_KEYS:
            section, _, key = dotted.partition(".")
            if key in raw.get(section, {}):
                raw[section][key] = _resolve(raw[section][key], source.parent)
        schema = raw.get("sampling", {}).get("json_schema")
        if isinstance(schema, str) and not schema.lstrip().startswith("{"):
            raw["sampling"]["json_schema"] = _resolve(schema, source.parent)  # a file path

    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        _check_keys({section: {key: None}}, f"--set {dotted}")
        parsed = _parse_value(dotted, value)
        raw.setdefault(section, {})[key] = _resolve(parsed, cwd) if dotted in _PATH_KEYS else parsed

    suffix = f" ({where})"
    try:
        for section in ("input", "output"):
            if "path" not in raw.get(section, {}):
                raise ConfigError(f"{section}.path: required")
        sections = {name: cls(**raw.get(name, {})) for name, cls in _SECTIONS.items()}
        job = JobConfig(**sections, source=source)
    except ConfigError as e:
        raise ConfigError(f"{e}{suffix}") from None
    configure_storage(job.storage)  # the process's object-store settings (batchjob.storage)
    return job
