"""Job manifest: the fingerprint of everything that determines a job's results.

Written with the first part file (``parts/manifest.json``) and, at commit, beside the
results (``manifest.json`` in the metadata folder). A resumed run and an "already complete"
answer require the stored fingerprint to equal this run's; otherwise the output belongs to
another job and the run stops with exit 3 naming the first field that differs.

In the fingerprint: the input files (path or URI, size, and a hash of every byte:
``sha256:``, or an S3 object's ``etag:``; ``storage.stores.content_id``) and row count, every
other input setting (prompt and max_tokens columns, row limit, ...); the model folder's identity
(config.json and tokenizer.json hashes, weight file names, sizes and mtimes), each LoRA
adapter's file hashes and every other model setting (dtype, max_model_len, adapters); every
sampling setting; the plan-shaping scheduler settings (enlarge, reorder); engine.backend;
output.reasoning_parser; the batchjob version.
Not in it (may differ between runs): threads, progress, chunk size, KV budget and threshold,
block size, attention backend, policy, device, id_column, batch_rows and every other output
setting (flush_rows, rows_per_file, overwrite).

Identity by content, not by size and mtime: a file rewritten with other bytes of the same size
and its old mtime restored is another input. The hash reads every byte once per run (1 GB: about
0.75 s of CPU with SHA-NI, plus the read; docs/operations.md).

The job comes in as its sections' plain values (``JobConfig.to_dict()``), the form the
manifest stores them in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchjob.storage.atomic import write_json_atomic
from batchjob.storage.stores import ObjectPath, content_id, file_stat, store_for
from batchjob.version import __version__

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _stat(path: str | Path) -> list[Any]:
    size, mtime_ns = file_stat(str(path))  # a local file or an object
    return [str(path), size, mtime_ns]


def _content(path: str) -> list[Any]:
    """[path, size, content hash] of one input file (streamed; see the module doc)."""
    try:
        return [str(path), file_stat(str(path))[0], content_id(str(path))]
    except OSError as e:
        from batchjob.errors import InputDataError

        raise InputDataError(f"{path}: cannot read the input file: {e}") from None


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(path: Path | None) -> dict[str, Any] | None:
    """What identifies a model folder's weights and tokenizer without reading the weights."""
    if path is None:
        return None
    folder = Path(path)
    weights = sorted(p for p in folder.glob("*") if p.suffix in _WEIGHT_SUFFIXES)
    return {
        "config_sha256": _sha256(folder / "config.json"),
        "tokenizer_sha256": _sha256(folder / "tokenizer.json"),
        "weights": [[p.name, *_stat(p)[1:]] for p in weights],
    }


# Every input/model/sampling key counts (a new key is assumed to change results) except these;
# of scheduler/engine only the named ones do (the rest shape the schedule, not the outputs).
_NOT_RESULTS = {"input.path", "input.batch_rows", "input.id_column", "model.path", "model.device"}
_SCHEDULE_KEYS_THAT_COUNT = {"scheduler.enlarge", "scheduler.reorder", "engine.backend"}
_OUTPUT_KEYS_THAT_COUNT = {"output.reasoning_parser"}  # it changes output_text


Sections = dict[str, dict[str, Any]]  # {"input": {"path": ..., ...}, "model": {...}, ...}


def fingerprint(config: Sections, input_files: Sequence[str], num_rows: int) -> dict[str, Any]:
    """Flat ``{"section.key": value}`` of what determines the results (JSON-able)."""
    fp: dict[str, Any] = {
        "batchjob.version": __version__,
        "input.files": [_content(f) for f in input_files],
        "input.num_rows": num_rows,
        "model.identity": model_identity(_path(config["model"].get("path"))),
    }
    adapters = config["model"].get("adapters") or {}
    if adapters:  # each LoRA adapter by its files' content
        fp["model.adapters.identity"] = {
            name: [_sha256(Path(folder) / f) for f in _ADAPTER_FILES]
            for name, folder in adapters.items()
        }
    for section, values in config.items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            counts = section in ("input", "model", "sampling") and dotted not in _NOT_RESULTS
            if counts or dotted in _SCHEDULE_KEYS_THAT_COUNT | _OUTPUT_KEYS_THAT_COUNT:
                fp[dotted] = value
    return json.loads(json.dumps(fp))  # the form it has after a JSON round trip


def manifest(
    config: Sections, job_file: Path | None, input_files: Sequence[str], num_rows: int
) -> dict[str, Any]:
    """The fingerprint plus what identifies the job to a reader (not compared)."""
    return {
        "fingerprint": fingerprint(config, input_files, num_rows),
        "job": {
            "input.path": config["input"]["path"],
            "model.path": config["model"].get("path") or None,
            "job_file": str(job_file) if job_file else None,
            "config": config,
        },
    }


def _path(value: Any) -> Path | None:
    return Path(value) if value else None


def read_manifest(path: Path | ObjectPath) -> dict[str, Any] | None:
    """The stored manifest, or None when absent or unreadable (treated as foreign)."""
    try:
        m = json.loads(store_for(path).read_text(path))
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("fingerprint"), dict) else None


def write_manifest(m: dict[str, Any], path: Path | ObjectPath) -> None:
    write_json_atomic(m, path)


def _short(v: Any, limit: int = 100) -> str:
    s = json.dumps(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def difference(this: dict[str, Any], stored: dict[str, Any] | None) -> str | None:
    """None when both manifests describe the same job; else which field differs and how."""
    if stored is None:
        return "no batchjob manifest (not written by batchjob, or by a version without one)"
    a, b = this["fingerprint"], stored["fingerprint"]
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
                i = next(i for i, (x, y) in enumerate(zip(va, vb, strict=True)) if x != y)
                va, vb = va[i], vb[i]
            if isinstance(va, list) and isinstance(vb, list) and va[:1] == vb[:1] and va:
                # one input file's entry, [path, size, content]: name it, show what differs
                j = [k for k in range(1, min(len(va), len(vb))) if va[k] != vb[k]] or [1]
                what = f"this run: {_short(va[j[0]])}; stored: {_short(vb[j[0]])}"
                return f"{key} differs for {va[0]} ({what})"
            return f"{key} differs (this run: {_short(va)}; stored: {_short(vb)})"
    return None
