"""Work folders a process owns while it runs (the partition spill of a streamed plan or run).

``owned_workdir(parent, prefix)`` makes ``<parent>/<prefix>XXXXXXXX/`` and holds an exclusive
``fcntl.flock`` on its ``.owner`` file for the ``with`` block; the folder is removed when the
block ends, however it ends short of SIGKILL. The kernel drops the lock when the process dies
(SIGKILL, the OOM killer), so ``clean_abandoned(parent, prefix)``, called before a new one is
made, removes every such folder whose lock it can take: its owner is gone. A folder with no
``.owner`` yet is removed only once older than ``GRACE_S`` (its owner may be creating it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OWNER = ".owner"
GRACE_S = 60.0


def _owner_gone(folder: Path) -> bool:
    try:
        fd = os.open(folder / OWNER, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime > GRACE_S
        except FileNotFoundError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner runs
    finally:
        os.close(fd)  # closing drops a lock taken here
    return True


def clean_abandoned(parent: Path, prefix: str) -> list[Path]:
    """Remove the ``prefix*`` folders under ``parent`` whose owner died; returns them."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for folder in parent.glob(f"{prefix}*"):
        if folder.is_dir() and _owner_gone(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextmanager
def owned_workdir(parent: Path, prefix: str) -> Iterator[Path]:
    """A new folder under ``parent``, locked as this process's until the block ends, then
    removed. Abandoned folders of the same prefix are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    clean_abandoned(parent, prefix)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = os.open(folder / OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
