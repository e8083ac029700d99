"""Load a local Hugging Face checkpoint folder into a ``LlamaForCausalLM``.

The model is built on the ``meta`` device (no memory), then each parameter is filled from
the safetensors files opened lazily with ``safe_open`` straight onto the target device: one
checkpoint tensor is in flight at a time, the full state dict never exists twice.
What to build (architecture, dtype, device) comes from ``batchjob.model.info.ModelInfo``, the
one reader of the folder; its tensor-name -> file map comes from the safetensors headers.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchjob.backends.native.models.cpu_linear import use_cpu_linear
from batchjob.backends.native.models.llama import LlamaForCausalLM
from batchjob.backends.native.models.onednn_linear import use_onednn_linear
from batchjob.config import EngineConfig
from batchjob.errors import ModelError
from batchjob.model.hf_config import SUPPORTED_ARCHITECTURES
from batchjob.model.info import ModelInfo, read_model_info

log = logging.getLogger(__name__)

# every supported architecture is one class with config flags
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, LlamaForCausalLM
)


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))


# where a multimodal checkpoint keeps its language model's tensors (Gemma3's: the Hub's
# files, and transformers >= 4.52's saves): tried for a name the checkpoint lacks
_LANGUAGE_MODEL_PREFIXES = (
    ("model.", "language_model.model."),
    ("model.", "model.language_model."),
    ("lm_head.", "language_model.lm_head."),
)


def _checkpoint_name(name: str, files) -> str:
    """``name`` as the checkpoint spells it: itself, or under a language-model prefix."""
    if name in files:
        return name
    for ours, theirs in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(ours) and theirs + name[len(ours) :] in files:
            return theirs + name[len(ours) :]
    return name


def _load_weights(model: LlamaForCausalLM, info: ModelInfo) -> None:
    files, folder = info.tensor_files, info.path
    dtype, device = info.torch_dtype, info.torch_device
    params = dict(model.named_parameters())
    with ExitStack() as stack:
        handles = {}
        for name, sources in model.checkpoint_sources().items():
            parts = []
            for src in (_checkpoint_name(n, files) for n in sources):
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
    model: str | Path | ModelInfo,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    attention: str = EngineConfig.attention,  # the one default, engine.attention's
    linear: str = EngineConfig.linear,
) -> tuple[LlamaForCausalLM, ModelInfo]:
    """Build the model, ready for ``forward``, from a ``ModelInfo`` or a model folder.

    A folder is read with ``read_model_info(folder, dtype, device)``; a ``ModelInfo`` (the
    job's, read once) already carries its dtype and device, and ``dtype``/``device`` are
    ignored. ``attention`` picks the backend (see ``attention.registry``); the result is
    ``model.attn_backend`` and may be replaced afterwards. ``linear``: ``auto`` runs a float32
    CPU model's batches of up to 2048 rows on the C kernel where it is faster
    (``cpu_linear``), and a bfloat16 CPU model's on weights oneDNN packed once
    (``onednn_linear``).
    """
    from batchjob.backends.native.attention.registry import get_attention_backend

    if isinstance(model, ModelInfo):
        info = model
    else:
        if not Path(model).is_dir():
            raise ModelError(f"model folder {model} does not exist")
        dt = str(dtype).removeprefix("torch.")
        info = read_model_info(model, dt, str(device))
    dev = info.torch_device
    long_rope = info.config.long_rope(info.max_model_len)
    if long_rope:  # vLLM's rule and warning: a context past the original takes the long set
        original = info.config.rope.original_max_position
        log.warning(
            "longrope: the long factors for a context of %d tokens (the original is %d); "
            "model.max_model_len <= %d runs the short ones, as for shorter sequences",
            info.max_model_len, original, original,
        )  # fmt: skip
    with torch.device("meta"):
        net = MODEL_CLASSES[info.architecture](info.config, info.torch_dtype, long_rope=long_rope)
    _load_weights(net, info)
    net.fold_norm_offsets()
    net.to(dev).eval()
    net.attn_backend = get_attention_backend(attention, dev)
    if linear == "auto" and dev.type == "cpu" and info.torch_dtype == torch.float32:
        use_cpu_linear(net)
    elif linear == "auto" and dev.type == "cpu" and info.torch_dtype == torch.bfloat16:
        use_onednn_linear(net)
    return net, info
