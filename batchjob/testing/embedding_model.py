"""Tiny embedding-model folders: a ``make_tiny_model`` checkpoint with the sentence-transformers
files real embedding models ship (``modules.json``, ``1_Pooling/config.json``), as
Qwen3-Embedding (last token, normalized) or gte/e5-style (mean) folders lay them out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchjob.testing.tiny_model import make_tiny_model

# batchjob's model.pooling -> the sentence-transformers pooling_mode_* flag
ST_MODES = {"last": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}


def write_sentence_transformers_files(
    folder: str | Path, pooling: str, normalize: bool, hidden: int
) -> None:
    """``modules.json`` (Transformer, Pooling, and Normalize when ``normalize``) and
    ``1_Pooling/config.json`` with ``pooling``'s flag on (``last``, ``mean`` or ``cls``)."""
    out = Path(folder)
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        kind = "sentence_transformers.models.Normalize"
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": kind})
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    flags = {f"pooling_mode_{m}": m == ST_MODES[pooling] for m in ST_MODES.values()}
    config = {"word_embedding_dimension": hidden, **flags, "include_prompt": True}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_tiny_embedding_model(
    out_dir: str | Path,
    family: str = "qwen3",
    pooling: str | None = "last",
    normalize: bool = True,
    matryoshka: bool = False,
    **model_kw: Any,
) -> Path:
    """A random-weight ``family`` checkpoint laid out as an embedding model: with
    sentence-transformers files for ``pooling`` (None: none, the folder is a plain
    checkpoint) and ``is_matryoshka`` in config.json when ``matryoshka``."""
    out = make_tiny_model(out_dir, family=family, **model_kw)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    if pooling is not None:
        write_sentence_transformers_files(out, pooling, normalize, config["hidden_size"])
    if matryoshka:
        config["is_matryoshka"] = True
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    return out
