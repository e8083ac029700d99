"""One run per output: an exclusive ``fcntl.flock`` on ``<meta>/lock``, taken before any work.

The kernel drops the lock when the process ends however it ends (SIGKILL included), so a
stale lock file never blocks a rerun. A second run gets ``LockedError`` (exit 75) at once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from batchjob.errors import ConfigError, LockedError


@contextmanager
def output_lock(lock_file: Path, output: Path) -> Iterator[None]:
    """Hold the lock of ``output`` for the ``with`` block (the holder's pid in the file)."""
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ConfigError(f"output.path: cannot create the lock file {lock_file}: {e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise LockedError(
                f"output.path: another batchjob run (pid {holder}) is writing {output}; "
                "this run did nothing. Wait for it to finish, or choose another output.path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
