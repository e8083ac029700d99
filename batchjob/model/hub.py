"""Models named as vLLM and transformers users name them: a Hugging Face Hub id
(``Qwen/Qwen2.5-0.5B``) resolved to its snapshot folder in the Hub cache.

``model_folder`` is the one resolver (``model.path`` and ``model.tokenizer`` go through it
when the job is loaded): a local folder that exists always wins; otherwise an ``org/name``
value is looked up in the cache ``huggingface_hub`` keeps (``HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), at ``model.revision`` (a branch, tag or
commit; unset: ``main``). A cached snapshot is used as it is, with no network call; one not
in the cache is downloaded, unless ``HF_HUB_OFFLINE=1`` or the Hub cannot be reached: then a
``ModelError`` (exit 5) says so. Every later stage (the native loader, the tokenizer, the vLLM
backend) reads the resolved local folder.

Torch-free; ``huggingface_hub`` is imported only for a Hub id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from batchjob.errors import ModelError

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*")
# what a download fetches: config, tokenizer and safetensors weights (not .bin/.pt/.gguf copies)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(value: object) -> bool:
    """``org/name`` as the Hub spells a model repository (no leading ``/``, ``.`` or ``~``)."""
    text = str(value)
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text and "--" not in text


def hub_cache_dir() -> Path:
    """The Hub cache ``huggingface_hub`` uses, read from the environment now (its own
    constants are read once, at import)."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def model_folder(value: str | Path, key: str, revision: str | None) -> Path:
    """``value`` as a local folder: itself when it exists (or is no Hub id), else the Hub
    snapshot of the id ``value`` at ``revision``; ModelError naming ``key`` when neither."""
    path = Path(value).expanduser()
    if path.exists() or not is_hub_id(value):
        return path
    return hub_snapshot(str(value), key, revision)


def hub_snapshot(repo_id: str, key: str, revision: str | None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision``: the cached one, else downloaded
    where the network allows it (never with ``HF_HUB_OFFLINE=1``)."""
    at = f" at revision {revision!r}" if revision else ""
    cache = hub_cache_dir()
    where = f"{key}: {repo_id!r} is not a local folder, and the Hugging Face cache {cache}"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelError(f"{where} cannot be read without huggingface_hub") from None
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except Exception:  # not cached (LocalEntryNotFoundError) or a bad id (HFValidationError)
        pass
    if hub_offline():
        raise ModelError(
            f"{where} has no snapshot of it{at} (HF_HUB_OFFLINE is set: nothing is downloaded; "
            f"`hf download {repo_id}` where the network allows it, or give a local folder)"
        )
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS
            )
        )
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = f"{where} has no snapshot of it{at}, and downloading it failed: {reason}"
        raise ModelError(why) from None


def display_name(folder: Path | str) -> str:
    """The name users gave the model: ``org/name`` for a Hub snapshot folder
    (``.../models--org--name/snapshots/<rev>``), else the folder's own name."""
    path = Path(folder)
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name
