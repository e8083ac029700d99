"""vLLM's own shapes of a setting, taken where they map one to one onto batchjob's.

- ``sampling_table(params)``: a ``vllm.SamplingParams`` object as a ``[sampling]`` table,
  field for field (its defaults included: ``SamplingParams(max_tokens=64)`` samples at
  temperature 1.0 in vLLM and here); ``structured_outputs`` as ``json_schema``, ``regex`` or
  ``choice``. A field off its default that batchjob has no setting for is a ConfigError
  naming it; what only steers vLLM's streaming or internals (``output_kind``, ...) is left.
- ``is_engine_arg(name)``: whether a name is one of vLLM's common ``EngineArgs`` (an
  ``LLM(tensor_parallel_size=2)`` habit), so a misplaced one gets the key it belongs under.

Torch- and vLLM-free: ``SamplingParams`` is read by its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchjob.errors import ConfigError

# SamplingParams fields that only steer vLLM's own output streaming or internals
_VLLM_ONLY = frozenset(
    {"output_kind", "stream_interval", "skip_clone", "output_text_buffer_length", "extra_args"}
)
# vLLM's StructuredOutputsParams field -> batchjob's [sampling] key
_GUIDES = {"json": "json_schema", "regex": "regex", "choice": "choice"}
# vLLM EngineArgs names commonly written where batchjob's keys go
ENGINE_ARGS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "quantization",
        "enforce_eager",
        "gpu_memory_utilization",
        "max_num_batched_tokens",
        "max_model_len",
        "dtype",
        "distributed_executor_backend",
        "cpu_offload_gb",
        "max_loras",
        "enable_prefix_caching",
        "swap_space",
        "kv_cache_dtype",
        "max_lora_rank",
        "enable_lora",
        "speculative_config",
    }
)


def is_sampling_params(value: Any) -> bool:
    """Whether ``value`` is a ``vllm.SamplingParams`` (by its class, vLLM not imported)."""
    t = type(value)
    return t.__name__ == "SamplingParams" and t.__module__.startswith("vllm")


def _fields(obj: Any) -> tuple[str, ...]:
    names = getattr(obj, "__struct_fields__", None)  # msgspec Struct (vLLM 0.32)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(obj))
    return tuple(n for n in names if not n.startswith("_"))


def sampling_table(params: Any, keys: frozenset[str]) -> dict[str, Any]:
    """``params`` (a SamplingParams) as ``[sampling]`` keys; ``keys``: batchjob's keys."""
    default = type(params)()
    table: dict[str, Any] = {}
    for name in _fields(params):
        value, unset = getattr(params, name), getattr(default, name)
        if name == "structured_outputs":
            if value is not None:
                table |= _guide(value)
        elif name in keys:
            if value is None:  # seed, logprobs, logit_bias, ...: batchjob's default
                if name == "max_tokens":
                    raise ConfigError(
                        "sampling: SamplingParams.max_tokens = None (up to the context) has "
                        "no batchjob value; give a number"
                    )
                continue
            table[name] = [value] if name == "stop" and isinstance(value, str) else value
        elif name not in _VLLM_ONLY and value != unset:
            raise ConfigError(
                f"sampling: SamplingParams.{name} = {value!r} has no batchjob setting; "
                f"leave it at vLLM's default ({unset!r})"
            )
    return table


def _guide(so: Any) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams -> json_schema / regex / choice; any other constraint
    or option set (grammar, json_object, ...) is refused. ``disable_any_whitespace`` is
    left: batchjob writes compact JSON either way."""
    out: dict[str, Any] = {}
    for name in _fields(so):
        value = getattr(so, name)
        if name in _GUIDES and value is not None:
            out[_GUIDES[name]] = list(value) if name == "choice" else value
        elif name not in _GUIDES and name != "disable_any_whitespace" and value:
            raise ConfigError(
                f"sampling: SamplingParams.structured_outputs.{name} = {value!r} is not "
                "offered (json, regex and choice are)"
            )
    return out


def is_engine_arg(name: str) -> bool:
    """Whether ``name`` is one of the vLLM engine arguments users write where batchjob's keys
    go (a fixed list: checking vLLM's own would import vLLM on every misspelled key)."""
    return name in ENGINE_ARGS
