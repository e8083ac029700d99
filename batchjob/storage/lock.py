"""One run per output, taken before any work.

Local output: an exclusive ``fcntl.flock`` on ``<meta>/lock``. The kernel drops the lock when
the process ends however it ends (SIGKILL included), so a stale lock file never blocks a rerun.
A second run gets ``LockedError`` (exit 75) at once. The file holds the holder's pid and its
run token (``holder_token``): a cluster worker compares it with its own run's before each
part, so a worker left over from a dead run stops once another run holds the output.

Object store (``s3://``): no fcntl. The lock is the object ``<meta>/lock``, created with a
conditional put (``If-None-Match: *``: AWS S3 since 2024, MinIO, moto): of two runs exactly one
creates it, the other gets exit 75. It holds the writer's host and pid and is deleted when the
run ends (an exception or Ctrl-C included). A SIGKILLed run leaves it behind: a rerun on the
same host sees that the pid is gone and takes the lock over; a run on another host cannot know,
and exits 75 naming the object to delete once no run is writing. Where no conditional put is
possible (boto3 not installed, a server that answers 501, a non-S3 store) the lock object is
written for information only and the run assumes it is the single writer, saying so on stderr.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError, LockedError
from batchjob.storage.stores import (
    ObjectPath,
    ObjectStore,
    put_if_absent,
    put_if_match,
    read_versioned,
)

log = logging.getLogger(__name__)


def output_lock(
    lock_file: Path | ObjectPath, output: Any, token: str | None = None
) -> AbstractContextManager[None]:
    """Hold the lock of ``output`` for the ``with`` block (the holder's pid and ``token``, the
    run's id, in the lock)."""
    token = token or os.urandom(8).hex()
    if isinstance(lock_file, ObjectPath):
        return _object_lock(lock_file, output, token)
    return _file_lock(lock_file, output, token)


def holder_token(lock_file: Path | ObjectPath) -> str | None:
    """The run token in the lock (None: no lock, or one written without a token)."""
    if isinstance(lock_file, ObjectPath):
        return _holder(ObjectStore(lock_file.scheme), lock_file).get("token")
    try:
        lines = lock_file.read_text().split()
    except OSError:
        return None
    return lines[1] if len(lines) > 1 else None


@contextmanager
def _file_lock(lock_file: Path, output: Any, token: str) -> Iterator[None]:
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ConfigError(f"output.path: cannot create the lock file {lock_file}: {e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.pread(fd, 64, 0).decode(errors="replace").split() or ["?"])[0]
            raise LockedError(
                f"output.path: another batchjob run (pid {holder}) is writing {output}; "
                "this run did nothing. Wait for it to finish, or choose another output.path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{token}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _dead_here(holder: dict[str, Any]) -> bool:
    """The holder ran on this host and its process is gone (a killed run's leftover)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _holder(store: ObjectStore, lock: ObjectPath) -> dict[str, Any]:
    try:
        return _parse_holder(store.read_text(lock))
    except OSError:
        return {}


def _parse_holder(text: str | bytes) -> dict[str, Any]:
    try:
        h = json.loads(text)
    except ValueError:
        return {}
    return h if isinstance(h, dict) else {}


def _take_over(lock: ObjectPath, body: bytes) -> bool:
    """Replace the lock of a dead holder on this host by ours, only if the object is still
    that holder's version (two reruns both finding it dead: one wins). False: not dead, or
    someone else changed it first (or no conditional write here)."""
    try:
        seen = read_versioned(lock)
    except OSError:
        return False
    if seen is None or not _dead_here(_parse_holder(seen[0])):
        return False
    log.warning("taking over the lock %s of a run that is gone", lock)
    try:
        taken = put_if_match(lock, body, seen[1])
    except OSError:
        return False
    if taken is False:  # changed meanwhile; gone (released) is free to create again
        return bool(put_if_absent(lock, body))
    return bool(taken)


@contextmanager
def _object_lock(lock: ObjectPath, output: Any, token: str) -> Iterator[None]:
    store = ObjectStore(lock.scheme)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": token,
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    body = json.dumps(me).encode()
    created = put_if_absent(lock, body)
    if created is False and _take_over(lock, body):
        created = True
    if created is False:
        h = _holder(store, lock)
        who = f"pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('since', '?')}"
        raise LockedError(
            f"output.path: another batchjob run ({who}) is writing {output}; this run did "
            f"nothing. Wait for it to finish, or choose another output.path; if no run is "
            f"writing (one was killed on another machine), delete {lock}"
        )
    if created is None:
        log.warning(
            "%s: this object store offers no conditional put: no lock, this run assumes it is "
            "the only one writing %s",
            lock,
            output,
        )
        store.write_bytes(lock, body)
    try:
        yield
    finally:
        with suppress(OSError):
            if _holder(store, lock).get("token") == me["token"]:
                store.delete(lock)
