"""The one reader of a model folder: ``ModelInfo``, read once per job, used by every stage.

``read_model_info`` reads ``config.json`` and ``generation_config.json`` (the only code that
does), checks that the safetensors weights exist and that their headers parse and fit in
their files (headers only: cheap even for a 70B checkpoint), and resolves the job's dtype and
device. Tokenization (vocab size, context length), the plan summary (KV estimate) and every
backend (the native loader builds its ``nn.Module`` from ``info.config``) read the same
object, so ``batchjob plan`` and ``batchjob run`` agree on KV bytes per token and refuse the
same folders (``ModelError``, exit 5).

Torch-free: device ``auto`` imports torch only when the machine has a GPU driver at all.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from batchjob.errors import ModelError
from batchjob.model.hf_config import ModelConfig, parse_hf_config
from batchjob.model.host_cpu import CpuInfo, host_cpu

if TYPE_CHECKING:
    import torch

    from batchjob.config import ModelConfig as ModelSettings  # [model], not the HF config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
T = TypeVar("T")


class _FromConfig(Generic[T]):
    """A read-only attribute of ``ModelInfo`` that its ``config`` holds (typed by ``get``)."""

    def __init__(self, get: Callable[[ModelConfig], T]) -> None:
        self._get = get

    def __get__(self, info: ModelInfo, owner: type | None = None) -> T:
        return self._get(info.config)


@dataclass(frozen=True)
class ModelInfo:
    """A model folder as one job runs it: architecture, resolved dtype/device, context, KV size.

    Build it with ``read_model_info`` (or ``model_info_for_job``); never re-read config.json.

    - ``config``: the parsed architecture (layers, heads, rope, biases, eos/bos ids).
    - ``dtype``: resolved weight/activation/KV dtype name, one of ``DTYPE_BYTES``: an explicit
      job dtype, else ``auto`` = the checkpoint's dtype on CUDA and ``auto_cpu_dtype`` on CPU.
    - ``device``: resolved ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (``auto`` = cuda if available).
    - ``max_model_len``: longest prompt + output a request may have: the job's
      ``model.max_model_len`` if set, else ``max_seq_len`` (max positions).
    - ``kv_bytes_per_token``: K and V of one token over all layers, in ``dtype``.
    - ``weight_files``: the safetensors files; ``tensor_files``: tensor name -> its file.

    Equality ignores the folder's location and files (same model, same settings).
    """

    config: ModelConfig
    dtype: str
    device: str
    max_model_len: int
    path: Path = field(compare=False)
    weight_files: tuple[Path, ...] = field(compare=False, default=())
    tensor_files: Mapping[str, Path] = field(
        compare=False, default_factory=lambda: MappingProxyType({})
    )

    # -- the architecture, flat (what most readers need): read from ``config`` --
    architecture = _FromConfig(lambda c: c.architecture)
    num_layers = _FromConfig(lambda c: c.num_layers)
    num_heads = _FromConfig(lambda c: c.num_heads)
    num_kv_heads = _FromConfig(lambda c: c.num_kv_heads)
    head_dim = _FromConfig(lambda c: c.head_dim)
    vocab_size = _FromConfig(lambda c: c.vocab_size)
    max_position = _FromConfig(lambda c: c.max_position)  # max_position_embeddings
    sliding_window = _FromConfig(lambda c: c.sliding_window)
    # config.json + generation_config.json, deduplicated, in that order
    eos_token_ids = _FromConfig(lambda c: c.eos_token_ids)
    bos_token_id = _FromConfig(lambda c: c.bos_token_id)
    # the dtype config.json names (``torch_dtype`` / ``dtype``), if any
    checkpoint_dtype = _FromConfig(lambda c: c.torch_dtype)

    # -- derived --
    # longest prefix + prompt + output this model runs: max_position_embeddings
    max_seq_len = _FromConfig(lambda c: c.max_seq_len)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the native paged cache: [L, 2, num_blocks, block_size, Hkv, D]."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)


# ---------------------------------------------------------------------------------------
# dtype and device


def _gpu_driver_present() -> bool:
    """False when no NVIDIA/AMD driver is loaded: CUDA is then unavailable, torch unneeded."""
    return (
        Path("/proc/driver/nvidia").exists()
        or Path("/dev/kfd").exists()
        or any(Path("/dev").glob("nvidia[0-9]*"))
    )


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` if torch sees a GPU, else ``cpu``; others unchanged."""
    if device != "auto":
        return device
    if "torch" not in sys.modules and not _gpu_driver_present():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ``auto`` on CPU runs a half-precision checkpoint in bfloat16 where the CPU has bf16 matmul
# hardware (AMX-bf16 / AVX-512-BF16) and this is True. Measured on a Sapphire Rapids VM
# (benchmarks/bench_dtype.py; docs/benchmarks.md, Sapphire Rapids): bf16 engine throughput
# 1.2-1.8x float32's on the peer models, head dims 32/64/128.
CPU_AUTO_BF16 = True


def auto_cpu_dtype(
    checkpoint_dtype: str | None, cpu: CpuInfo | None = None, prefer_bf16: bool = CPU_AUTO_BF16
) -> str:
    """``auto`` on CPU: a bf16/fp16 checkpoint runs in bfloat16 when ``prefer_bf16`` and the
    CPU (default: this host) has bf16 hardware, else in float32 (without the hardware
    half-precision matmuls are emulated, slower than float32; fp16 has no fast CPU path
    either way). A float32 (or unnamed) checkpoint stays float32: ``auto`` never rounds
    weights below the checkpoint's precision (as vLLM's ``auto``)."""
    cpu = cpu or host_cpu()
    half = DTYPE_ALIASES.get(checkpoint_dtype or "", checkpoint_dtype) in ("bfloat16", "float16")
    return "bfloat16" if half and prefer_bf16 and cpu.has_fast_bf16 else "float32"


def resolve_dtype(
    dtype: str, checkpoint_dtype: str | None, device: str, cpu: CpuInfo | None = None
) -> str:
    """``auto`` -> ``auto_cpu_dtype`` on CPU (``cpu``: default this host), else the
    checkpoint's dtype."""
    if dtype == "auto":
        if device == "cpu":
            return auto_cpu_dtype(checkpoint_dtype, cpu)
        dtype = checkpoint_dtype or "float32"
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        choices = ", ".join(sorted([*DTYPE_BYTES, *DTYPE_ALIASES]))
        raise ModelError(f"unknown dtype {dtype!r} (use auto, {choices})")
    return name


# ---------------------------------------------------------------------------------------
# files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} must hold a JSON object")
    return data


def safetensors_tensor_names(path: Path) -> list[str]:
    """Tensor names in one safetensors file, from its header; ModelError if the header does
    not parse or a tensor's bytes lie past the end of the file (a truncated download)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ModelError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: safetensors header does not parse: {e}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: safetensors header is not a JSON object")
    names, end = [], 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(t["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise ModelError(f"{path}: tensor {name!r} has no valid data_offsets") from None
        names.append(name)
    if 8 + n + end > size:
        raise ModelError(
            f"{path}: truncated: tensors need {8 + n + end} bytes, the file has {size}"
        )
    return names


def read_tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> safetensors file holding it, from the headers alone."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index}: no weight_map")
        files = {name: folder / str(shard) for name, shard in weight_map.items()}
        shards = sorted(set(files.values()))
        for shard in shards:
            if not shard.is_file():
                raise ModelError(f"{index} lists shard {shard.name}, which is missing")
        for shard in shards:
            held = set(safetensors_tensor_names(shard))
            lost = [n for n, f in files.items() if f == shard and n not in held]
            if lost:
                raise ModelError(f"{index} puts {lost[0]!r} in {shard.name}, which lacks it")
        return files
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelError(
            f"no model.safetensors (or sharded *.safetensors + index) in {folder}; "
            "only safetensors checkpoints are supported"
        )
    return {name: path for path in paths for name in safetensors_tensor_names(path)}


_SIZES = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_heads"),
    ("num_key_value_heads", "num_kv_heads"),
    ("head_dim", "head_dim"),
    ("vocab_size", "vocab_size"),
    ("intermediate_size", "intermediate_size"),
)
# torch dtypes a checkpoint may declare beyond DTYPE_BYTES (the vLLM backend loads them)
_OTHER_CHECKPOINT_DTYPES = frozenset(
    {"float64", "double", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int4", "auto"}
)


def check_config_against_weights(
    config: ModelConfig, tensors: Mapping[str, Path], source: Path
) -> None:
    """config.json's sizes are positive, its dtype is a dtype, and its ``vocab_size`` covers
    the rows of the embedding in the weights: else ModelError naming ``source`` (config.json)
    rather than a later failure blaming the KV budget or the data."""
    for key, attr in _SIZES:
        value = getattr(config, attr)
        if value <= 0:
            raise ModelError(f"{source}: {key} is {value}; it must be a positive integer")
    declared = config.torch_dtype
    if declared is not None and (
        not isinstance(declared, str)
        or DTYPE_ALIASES.get(declared, declared) not in {*DTYPE_BYTES, *_OTHER_CHECKPOINT_DTYPES}
    ):
        raise ModelError(
            f"{source}: torch_dtype / dtype {declared!r} is not a dtype "
            f"(e.g. {', '.join(DTYPE_BYTES)})"
        )
    embed = sorted(n for n in tensors if n.endswith("embed_tokens.weight"))
    if embed:
        shape = _tensor_shape(tensors[embed[0]], embed[0])
        if shape and shape[0] > config.vocab_size:
            raise ModelError(
                f"{source}: vocab_size {config.vocab_size} is smaller than the {shape[0]} rows "
                f"of {embed[0]} in {tensors[embed[0]].name}; fix vocab_size"
            )


def _tensor_shape(path: Path, name: str) -> list[int] | None:
    """The shape of tensor ``name`` from its safetensors header (read before: it parses)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            shape = json.loads(f.read(n)).get(name, {}).get("shape")
    except (OSError, ValueError, struct.error, AttributeError):
        return None
    return [int(d) for d in shape] if isinstance(shape, list) else None


# ---------------------------------------------------------------------------------------
# the reader


def read_model_info(
    path: str | Path,
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    native: bool = True,
) -> ModelInfo:
    """Read a local HF model folder once: config files, weight headers, dtype, device.

    ``native``: the folder must be one the native engine runs (see ``parse_hf_config``).

    ModelError (exit 5) for a missing folder or config.json, an unsupported architecture or
    rope type, missing or truncated safetensors files, an unknown dtype.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(f"model.path: {folder} is not a directory")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{cfg_file}: missing (model.path must be a HF model folder)")
    gen_file = folder / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.is_file() else None
    config = parse_hf_config(_read_json(cfg_file), gen, cfg_file, native=native)
    tensors = read_tensor_files(folder)
    check_config_against_weights(config, tensors, cfg_file)
    dev = resolve_device(device)
    return ModelInfo(
        config=config,
        dtype=resolve_dtype(dtype, config.torch_dtype, dev),
        device=dev,
        max_model_len=max_model_len or config.max_seq_len,
        path=folder,
        weight_files=tuple(sorted(set(tensors.values()))),
        tensor_files=MappingProxyType(tensors),
    )


def model_info_for(m: ModelSettings, backend: str) -> ModelInfo | None:
    """The job's model folder read with its ``[model]`` settings; None without model.path.
    ``backend``: ``engine.backend`` (the dtype choice differs for vLLM)."""
    if m.path is None:
        return None
    native = backend == "native"
    return read_model_info(m.path, m.dtype, m.device, m.max_model_len, native=native)
