"""How an embedding job pools (``model.task = "embed"``): the job's ``[model]`` keys, else the
model folder's sentence-transformers files, as vLLM reads them (``get_pooling_config``).

- ``modules.json``: the pipeline's modules; its Pooling module's folder holds
  ``config.json`` with one ``pooling_mode_*`` flag true (``lasttoken``, ``mean_tokens``,
  ``cls_token``), and a Normalize module after it means unit-norm embeddings.
- No ``modules.json``: last-token pooling, normalized (vLLM's default for decoder models).
- ``dimensions`` (Matryoshka): the first N dimensions, then normalized; config.json must say
  the model was trained for it (``is_matryoshka`` or ``matryoshka_dimensions``), as vLLM asks.

Torch-free: ``batchjob plan`` reports it and both backends run it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.config import ModelConfig
from batchjob.errors import ConfigError, ModelError

_POOLING_TYPES = ("sentence_transformers.models.Pooling", "Pooling")
_NORMALIZE_TYPES = ("sentence_transformers.models.Normalize", "Normalize")
_DENSE_TYPES = ("sentence_transformers.models.Dense", "Dense")
# sentence-transformers pooling_mode_* flags -> model.pooling (the ones batchjob computes)
_MODES = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}


@dataclass(frozen=True)
class PoolingSpec:
    """What every row's embedding is: ``method`` over the final hidden states (after the
    model's last norm), cut to ``dimensions``, then L2-normalized when ``normalize``."""

    method: str  # "last" | "mean" | "cls"
    normalize: bool
    dimensions: int | None  # None: the hidden size
    source: str  # where the method came from: "model.pooling", a file, or "default"

    def describe(self) -> str:
        dims = f", first {self.dimensions} dimensions" if self.dimensions else ""
        norm = ", normalized" if self.normalize else ""
        return f"{self.method} pooling ({self.source}){dims}{norm}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not readable JSON ({e.__class__.__name__}: {e})") from None


def _module_type(item: Any) -> str:
    return str(item.get("type", "")) if isinstance(item, dict) else ""


def _is(item: Any, names: tuple[str, ...]) -> bool:
    kind = _module_type(item)
    return any(kind == n or kind.endswith("." + n) for n in names)


def _folder_pooling(folder: Path) -> tuple[str | None, bool | None, str]:
    """(method, normalize, source) from the folder's sentence-transformers files; (None,
    None, "default") without modules.json."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, None, "default"
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelError(f"{modules_file}: must be a list of modules")
    if any(_is(m, _DENSE_TYPES) for m in modules):
        raise ModelError(
            f"{modules_file}: a Dense module after pooling is not applied by batchjob; "
            "embedding models with one are not supported"
        )
    normalize = any(_is(m, _NORMALIZE_TYPES) for m in modules)
    pooling = next((m for m in modules if _is(m, _POOLING_TYPES)), None)
    if pooling is None:
        return None, normalize, "default"
    config_file = folder / str(pooling.get("path", "")) / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{config_file}: missing (the Pooling module of {modules_file})")
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelError(f"{config_file}: must be a JSON object")
    on = [k.removeprefix("pooling_mode_") for k, v in config.items() if v is True]
    on = [k for k in on if k != "include_prompt"]
    if isinstance(config.get("pooling_mode"), str):
        on = [str(config["pooling_mode"])]
    if config.get("include_prompt") is False:
        raise ModelError(
            f"{config_file}: include_prompt = false (pooling that leaves the instruction "
            "out) is not supported; set model.pooling to pool over every prompt token"
        )
    if len(on) != 1 or on[0] not in _MODES:
        known = ", ".join(f"pooling_mode_{k}" for k in _MODES)
        raise ModelError(
            f"{config_file}: pooling {', '.join(on) or 'none'} is not supported (one of "
            f"{known}); set model.pooling to choose"
        )
    return _MODES[on[0]], normalize, str(config_file)


def _check_dimensions(dimensions: int, hidden: int, folder: Path) -> None:
    config = _read_json(folder / "config.json")
    config = config if isinstance(config, dict) else {}
    allowed = config.get("matryoshka_dimensions")
    if not (allowed or config.get("is_matryoshka")):
        raise ConfigError(
            f"model.dimensions: {folder / 'config.json'} declares no Matryoshka training "
            "(is_matryoshka or matryoshka_dimensions), so a cut embedding means nothing; "
            f"unset it, got {dimensions}"
        )
    if dimensions > hidden:
        raise ConfigError(
            f"model.dimensions: must be <= the hidden size {hidden}, got {dimensions}"
        )
    if isinstance(allowed, list) and dimensions not in allowed:
        raise ConfigError(f"model.dimensions: must be one of {allowed}, got {dimensions}")


def pooling_spec(model: ModelConfig, folder: Path, hidden_size: int) -> PoolingSpec:
    """The embedding job's pooling: ``model.pooling`` / ``model.normalize`` where set, else
    the folder's sentence-transformers files, else last-token and normalized (vLLM's)."""
    method, normalize, source = _folder_pooling(folder)
    if model.pooling != "auto":
        method, source = model.pooling, "model.pooling"
    if model.dimensions is not None:
        _check_dimensions(model.dimensions, hidden_size, folder)
    return PoolingSpec(
        method=method or "last",
        normalize=model.normalize if model.normalize is not None else normalize is not False,
        dimensions=model.dimensions,
        source=source,
    )


def describe_embedding(model: ModelConfig, info: Any) -> str | None:
    """``batchjob plan``'s line for an embedding job (``info``: its ``ModelInfo``, or None
    without a model folder); None for a generation job."""
    if model.task != "embed":
        return None
    if info is None:
        return "embed (pooling: no model folder to read)"
    return "embed, " + pooling_spec(model, info.path, info.config.hidden_size).describe()
