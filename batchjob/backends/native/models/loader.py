"""Load a local Hugging Face checkpoint folder into a ``LlamaForCausalLM``.

The model is built on the ``meta`` device (no memory), then each parameter is filled from
the safetensors files opened lazily with ``safe_open`` straight onto the target device: one
checkpoint tensor is in flight at a time, the full state dict never exists twice.
dtype "auto" is the checkpoint's dtype on CUDA and float32 on CPU (bf16/fp16 matmuls on CPU
are many times slower than fp32 there).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchjob.backends.native.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    parse_config,
)
from batchjob.backends.native.models.llama import LlamaForCausalLM
from batchjob.errors import ModelError

# every supported architecture is one class with config flags
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, LlamaForCausalLM
)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int  # config max_position_embeddings
    eos_token_ids: tuple[int, ...]  # config.json + generation_config.json, deduplicated
    bos_token_id: int | None
    dtype: torch.dtype  # weights, activations and KV cache
    device: torch.device
    kv_bytes_per_token: int  # K and V of one token over all layers
    sliding_window: int | None = None  # Mistral-style window (not implemented: a length cap)

    @property
    def max_seq_len(self) -> int:
        """Longest prefix + prompt + output this model runs correctly here."""
        if self.sliding_window is None:
            return self.max_position
        return min(self.max_position, self.sliding_window)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the paged cache ``model.forward`` takes: [L, 2, NB, BS, Hkv, D]."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: torch.device):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = config_dtype or "float32"
    if dtype not in _DTYPES:
        raise ModelError(f"unknown dtype {dtype!r} (use auto, {', '.join(sorted(_DTYPES))})")
    return _DTYPES[dtype]


def _weight_map(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"cannot read weight_map from {index}: {e}") from e
        files = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelError(f"{index} lists shard {shard.name}, which is missing")
        return files
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ModelError(
            f"no model.safetensors (or sharded *.safetensors + index) in {folder}; "
            "only safetensors checkpoints are supported"
        )
    files = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))


def _load_weights(model: LlamaForCausalLM, folder: Path, dtype, device: torch.device) -> None:
    files = _weight_map(folder)
    params = dict(model.named_parameters())
    with ExitStack() as stack:
        handles = {}
        for name, sources in model.checkpoint_sources().items():
            parts = []
            for src in sources:
                if src not in files:
                    raise ModelError(f"tensor {src!r} is missing from the checkpoint in {folder}")
                path = files[src]
                if path not in handles:
                    handles[path] = stack.enter_context(
                        safe_open(str(path), framework="pt", device=_safetensors_device(device))
                    )
                try:
                    parts.append(handles[path].get_tensor(src).to(dtype))
                except Exception as e:  # a corrupt or truncated shard, a name not in the file
                    raise ModelError(f"cannot read tensor {src!r} from {path}: {e}") from e
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            del parts
            if tensor.shape != params[name].shape:
                raise ModelError(
                    f"checkpoint tensor(s) {sources} have shape {tuple(tensor.shape)}, "
                    f"config implies {tuple(params[name].shape)}"
                )
            _set_param(model, name, tensor.contiguous())


def load_model(
    folder: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    attention: str = "auto",
) -> tuple[LlamaForCausalLM, ModelInfo]:
    """Build the model from ``folder`` (config.json + safetensors), ready for ``forward``.

    ``attention`` picks the backend (see ``engine.attention.get_attention_backend``); the
    result is ``model.attn_backend`` and may be replaced afterwards.
    """
    from batchjob.backends.native.attention.registry import get_attention_backend

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"model folder {folder} does not exist")
    cfg: ModelConfig = parse_config(folder)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, cfg.torch_dtype, dev)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, dt)
    _load_weights(model, folder, dt, dev)
    model.to(dev).eval()
    model.attn_backend = get_attention_backend(attention, dev)
    itemsize = torch.empty((), dtype=dt).element_size()
    info = ModelInfo(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position,
        eos_token_ids=cfg.eos_token_ids,
        bos_token_id=cfg.bos_token_id,
        dtype=dt,
        device=dev,
        kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize,
        sliding_window=cfg.sliding_window,
    )
    return model, info
