"""What at an output is batchjob's, and the paths an output may not take (checked before work).

No two output paths share a metadata folder, and no output path is another's metadata folder:
a path whose name ends in ``.meta`` is refused, as is a path inside another output's results or
metadata folder, or one that is, holds or sits inside the input. In a results folder batchjob
knows its own files by its ``_SUCCESS`` (JSON, ``"committer": "batchjob"``), by the committed
manifest and by an in-place commit's ``commit.json``; anything else there (``foreign_entries``)
is refused unless ``output.allow_other_files``, and batchjob never deletes it. Every refusal is
a ``ConfigError`` (exit 3) naming ``output.path``.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError
from batchjob.outputs.naming import COMMITTER, META_SUFFIX, OUR_TEMP, SUCCESS, OutputLayout, meta_of
from batchjob.storage.stores import ObjectPath, is_uri, store_for


def _read_text(store: Any, path: Any) -> str:
    """The file's text, or "" when it cannot be read (absent, a folder, not text)."""
    try:
        return str(store.read_text(path))
    except (OSError, ValueError, UnicodeDecodeError):
        return ""


def _read_json(store: Any, path: Any) -> dict[str, Any] | None:
    try:
        v = json.loads(_read_text(store, path) or "null")
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def _manifest_output(m: dict[str, Any] | None) -> str | None:
    """The output.path a manifest was written for (every batchjob manifest records it)."""
    try:
        v = m["job"]["config"]["output"]["path"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return v if isinstance(v, str) else None


def _same_str(a: str, b: Path | ObjectPath) -> bool:
    """Does the recorded output path ``a`` name ``b``?"""
    if isinstance(b, ObjectPath):
        return is_uri(a) and ObjectPath(a) == b
    return not is_uri(a) and os.path.normpath(os.path.abspath(a)) == os.path.normpath(
        os.path.abspath(b)
    )


# ----------------------------------------------------------------------------------------
# what in the results folder is batchjob's


def read_success(layout: OutputLayout) -> dict[str, Any] | None:
    """The results folder's ``_SUCCESS`` when batchjob wrote it (its commit, rows, files)."""
    if layout.single_file:
        return None
    s = _read_json(layout.store, layout.output / SUCCESS)
    return s if s is not None and s.get("committer") == COMMITTER else None


def owned_results(layout: OutputLayout) -> set[str]:
    """Names in the results folder that batchjob wrote for this output: the files listed by
    its ``_SUCCESS``, the committed manifest and an unfinished in-place commit, those files'
    temp files, ``_SUCCESS`` itself."""
    if layout.single_file:
        return set()
    store = layout.store
    present = set(store.names(layout.output))
    owned: set[str] = set()
    if (s := read_success(layout)) is not None:
        owned |= set(s.get("files") or []) | {SUCCESS}
    m = _read_json(store, layout.manifest_file) or {}
    owned |= set((m.get("results") or {}).get("files") or [])
    log = _read_json(store, layout.commit_log) or {}
    owned |= set(log.get("files") or []) | set(log.get("replaces") or [])
    owned |= {n for n in present if OUR_TEMP.fullmatch(n)}
    return owned & present


def foreign_entries(layout: OutputLayout) -> list[str]:
    """What the results folder holds that batchjob did not write (never deleted)."""
    if layout.single_file:
        return []
    owned = owned_results(layout)
    return [n for n in layout.store.names(layout.output) if n not in owned]


def swappable(layout: OutputLayout) -> bool:
    """A local results folder that is batchjob's alone and can be swapped by rename: not
    a link or a mount point, on the metadata folder's filesystem, no foreign entries."""
    if layout.remote or layout.single_file:
        return False
    out, meta = layout.output, layout.meta
    assert isinstance(out, Path) and isinstance(meta, Path)
    if out.is_symlink():
        return False
    if not out.exists():
        return True
    if os.path.ismount(out) or foreign_entries(layout):
        return False
    return out.stat().st_dev == meta.stat().st_dev


def committed_files(results: Path | ObjectPath) -> list[Any]:
    """The files of committed results: the results file, or the files a results folder's
    batchjob ``_SUCCESS`` lists (a folder shared with other files holds more); none for a
    folder without one."""
    store = store_for(results)
    if not store.is_dir(results):
        return [results]
    s = _read_json(store, results / SUCCESS)
    if s is None or s.get("committer") != COMMITTER:
        return []
    names = [n for n in s.get("files") or [] if isinstance(n, str)]
    return [results / n for n in names if n not in (".", "..") and "/" not in n]


# ----------------------------------------------------------------------------------------
# checks before any work


def check_output(
    layout: OutputLayout, input_path: str, input_files: tuple[str, ...] | list[str]
) -> None:
    """Refuse an output that is, holds or sits inside the input, the wrong kind of path,
    a metadata folder, a path inside another output, or an OpenAI Batch file another output's
    job writes; ``ConfigError`` (exit 3)."""
    out = layout.output
    if not out.name or out.name in (".", ".."):
        raise ConfigError(f"output.path: {str(out)!r} names no file or folder")
    if out.name.endswith(META_SUFFIX):
        raise ConfigError(
            f"output.path: {out} ends in {META_SUFFIX}, the name batchjob gives "
            "metadata folders (another output's metadata may live there): choose "
            "another output.path"
        )
    if isinstance(out, ObjectPath):
        _check_remote(layout, input_path, input_files)
    else:
        _check_local(layout, input_path, input_files)
    check_jsonl_twin(layout)


def _check_local(
    layout: OutputLayout, input_path: str, input_files: tuple[str, ...] | list[str]
) -> None:
    assert isinstance(layout.meta, Path) and isinstance(layout.output, Path)
    output = layout.output
    out = output.resolve()
    meta = layout.meta.resolve()
    for f in input_files:
        fp = Path(f).resolve()
        if fp in (out, meta) or out in fp.parents or meta in fp.parents:
            raise ConfigError(
                f"output.path: {output} is or holds the input file {f} "
                "(input.path); results would replace the input: choose another output.path"
            )
    inp = Path(input_path)
    if not inp.exists() and fnmatch.fnmatch(str(out), input_path):
        raise ConfigError(
            f"output.path: {output} matches the input pattern {input_path} "
            "(input.path); the next run would read the results as input: choose another "
            "output.path"
        )
    if inp.is_dir() and (inp.resolve() in out.parents or inp.resolve() in meta.parents):
        raise ConfigError(
            f"output.path: {output} is inside the input folder {input_path} "
            "(input.path); the next run would read the results as input: choose another "
            "output.path"
        )
    for anc in out.parents:
        if not anc.name:
            continue
        if anc.name.endswith(META_SUFFIX) and (anc / "lock").exists():
            raise ConfigError(
                f"output.path: {output} is inside {anc}, the metadata folder of "
                "another output: choose another output.path"
            )
        if (meta_of(anc) / "lock").exists():
            raise ConfigError(
                f"output.path: {output} is inside {anc}, the results folder of "
                "another batchjob output: choose another output.path"
            )
    if layout.single_file and output.is_dir():
        raise ConfigError(
            f"output.path: {output} is a folder; a path ending in .parquet names "
            "one results file (drop the suffix for a results folder)"
        )
    if not layout.single_file and output.exists() and not output.is_dir():
        raise ConfigError(
            f"output.path: {output} is a file; a path not ending in .parquet names a results folder"
        )


def _check_remote(
    layout: OutputLayout, input_path: str, input_files: tuple[str, ...] | list[str]
) -> None:
    """check_output for an object-store output: the same rules on URI strings."""
    assert isinstance(layout.output, ObjectPath) and isinstance(layout.meta, ObjectPath)
    out, meta = layout.output, layout.meta
    for f in input_files:
        if is_uri(f) and (ObjectPath(f).is_relative_to(out) or ObjectPath(f).is_relative_to(meta)):
            raise ConfigError(
                f"output.path: {out} is or holds the input file {f} (input.path); results "
                "would replace the input: choose another output.path"
            )
    if is_uri(input_path):
        inp = ObjectPath(input_path)
        if (
            fnmatch.fnmatchcase(out.uri, inp.uri)
            or out.is_relative_to(inp)
            or meta.is_relative_to(inp)
        ):
            raise ConfigError(
                f"output.path: {out} is inside or matches the input {input_path} "
                "(input.path); the next run would read the results as input: choose "
                "another output.path"
            )
    key = out.key.split("/")
    if any(part.endswith(META_SUFFIX) for part in key[1:-1]):
        raise ConfigError(
            f"output.path: {out} is inside a folder named *{META_SUFFIX}, where batchjob "
            "keeps an output's metadata: choose another output.path"
        )
    store = layout.store
    if layout.single_file and store.is_dir(out):
        raise ConfigError(
            f"output.path: {out} is a folder; a path ending in .parquet names one results "
            "file (drop the suffix for a results folder)"
        )
    if not layout.single_file and store.is_file(out):
        raise ConfigError(
            f"output.path: {out} is an object; a path not ending in .parquet names a results folder"
        )


def check_results_folder(layout: OutputLayout) -> None:
    """Before writing: a results folder that holds anything batchjob did not write is
    refused (exit 3) unless ``output.allow_other_files``; a ``_SUCCESS`` batchjob did not
    write is refused always (the commit would replace it)."""
    foreign = foreign_entries(layout)
    if not foreign:
        return
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    if SUCCESS in foreign:
        raise ConfigError(
            f"output.path: {layout.output} holds a {SUCCESS} that batchjob did not write "
            "(another tool's results); batchjob would replace it: choose another "
            "output.path"
        )
    if not layout.others_allowed:
        raise ConfigError(
            f"output.path: {layout.output} is a folder holding files batchjob did not write "
            f"({shown}); batchjob never deletes them, and a results folder holds only "
            "results: choose a new or empty folder, or set output.allow_other_files = true "
            "to write the results beside them"
        )


def check_jsonl_twin(layout: OutputLayout) -> None:
    """``output.format = "openai-jsonl"`` writes ``out/res.jsonl`` for both ``out/res`` and
    ``out/res.parquet``: refuse when the other one's job writes it already."""
    if not layout.writes_jsonl:
        return
    twin = layout.twin
    twin_meta = meta_of(twin)
    for f in (twin_meta / "manifest.json", twin_meta / "parts" / "manifest.json"):
        m = _read_json(layout.store, f)
        fmt = (((m or {}).get("job") or {}).get("config") or {}).get("output", {})
        owner = _manifest_output(m)
        if fmt.get("format") == "openai-jsonl" and owner and _same_str(owner, twin):
            raise ConfigError(
                f"output.path: {layout.jsonl_file} is already the OpenAI Batch output of the "
                f"job writing {twin}: choose another output.path"
            )
