"""What a killed run leaves at its output, and how the next run puts it right (lock held).

Commit modes of a folder (``results.ResultSink``): ``swap`` (local, the folder batchjob's own:
the staged folder is exchanged with the old one in one ``renameat2(RENAME_EXCHANGE)``, or two
renames, the old folder parked in ``previous/`` between them) and ``in place`` (object stores,
and a local folder shared with other files: ``_SUCCESS`` removed, new files written, old ones
deleted, ``_SUCCESS`` written last; docs/operations.md says what readers see). Parts and their
manifest outlive a kill: the same job resumes them, another job's are dropped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from batchjob.outputs.naming import OUR_TEMP, OutputLayout


def drop_parts(layout: OutputLayout) -> None:
    """Remove another job's parts (all or nothing locally: renamed away first)."""
    if layout.remote:
        layout.store.delete_tree(layout.parts)
        return
    if layout.parts.exists():
        shutil.rmtree(layout.trash, ignore_errors=True)
        layout.parts.rename(layout.trash)
        shutil.rmtree(layout.trash)


def clean_stale(layout: OutputLayout) -> None:
    """Put right what a killed run can leave; call with the lock held. A commit killed
    between its two renames (no rename-exchange) left the old results in ``previous/``
    and no results folder: they are moved back (the parts recommit). Staging,
    half-removed parts and batchjob's temp files are removed; parts and their manifest
    are kept (they resume). An object store has no staging and no temp objects; its
    half-removed parts carry a marker."""
    out, meta = layout.output, layout.meta
    if not isinstance(meta, Path) or not isinstance(out, Path):
        if layout.store.exists(layout.cleanup_marker):  # a kill during results.cleanup
            layout.store.delete_tree(layout.parts)
        return
    if layout.previous.is_dir():
        if not out.exists() and not out.is_symlink():
            os.rename(layout.previous, out)
        else:
            shutil.rmtree(layout.previous)
    shutil.rmtree(layout.staging, ignore_errors=True)
    shutil.rmtree(layout.trash, ignore_errors=True)
    for folder in (meta, layout.parts, out.parent):
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp"):
                if folder != out.parent or tmp.name.startswith(f".{out.name}."):
                    tmp.unlink(missing_ok=True)
    if not layout.single_file and out.is_dir():
        for name in os.listdir(out):
            if OUR_TEMP.fullmatch(name):
                (out / name).unlink(missing_ok=True)
