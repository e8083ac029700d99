"""Atomic file writes: readers see the old file or the whole new one, never a part.

Every writer here goes through ``atomic_open``: a temp file in the target's folder (created
if missing), written, flushed and fsynced, renamed over the target with ``os.replace``, then
the folder is fsynced so the rename survives a crash. On any error, KeyboardInterrupt
included, the temp file is removed and the target is left untouched. The file's mode follows
the umask (``0o666 & ~umask``) like a plain ``open``, not mkstemp's 0600.

Temp names are ``.<name>.<random>.tmp``: hidden, and never matching a ``*.parquet`` glob.
``make_parent=False`` refuses to create a missing folder (``FileNotFoundError``): a writer that
must not outlive its folder (a cluster worker whose run was committed) cannot bring it back.

``rename_exchange(a, b)`` swaps two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``):
the folder commit uses it so a reader of the results folder sees the old folder or the new one.

An object-store path (``batchjob.storage.stores.ObjectPath``, ``s3://bucket/key``) is written into
memory and uploaded as one PUT when the block ends without an exception: readers see the old
object or the whole new one (there are no temp objects, and nothing to fsync).
Stdlib only at import time (the planner and the kernels' callers import this).
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, overload

from batchjob.storage.faults import fault_point
from batchjob.storage.stores import ObjectPath, ObjectStore

if TYPE_CHECKING:
    import pyarrow as pa
    from matplotlib.figure import Figure

Target = str | os.PathLike[str] | ObjectPath  # a local path, or an object-store URI path

__all__ = [
    "Target",
    "atomic_open",
    "current_umask",
    "fsync_dir",
    "rename_exchange",
    "save_figure_atomic",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_parquet_atomic",
    "write_text_atomic",
]


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else swapped."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # not thread-safe, hence only the fallback
    os.umask(mask)
    return mask


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def rename_exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap the paths ``a`` and ``b`` (both must exist, on one filesystem) in one atomic step:
    True when done, False where the kernel, libc or filesystem has no such call (then nothing
    changed). ``BATCHJOB_RENAME_EXCHANGE=0`` answers False (tests of the fallback)."""
    if os.environ.get("BATCHJOB_RENAME_EXCHANGE") == "0":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), f"{a} <-> {b}")


@overload
def atomic_open(
    path: Target, mode: Literal["wb"] = "wb", *, make_parent: bool = True
) -> AbstractContextManager[IO[bytes]]: ...
@overload
def atomic_open(
    path: Target, mode: Literal["w"], *, make_parent: bool = True
) -> AbstractContextManager[IO[str]]: ...
def atomic_open(
    path: Target, mode: str = "wb", *, make_parent: bool = True
) -> AbstractContextManager[IO[Any]]:
    """``with atomic_open(path) as f: f.write(...)`` publishes ``path`` only if the block ends
    without an exception. ``mode`` is "wb" (bytes) or "w" (UTF-8 text). ``make_parent``:
    create the folder if missing (else ``FileNotFoundError``; an object store has no folders)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open mode must be 'wb' or 'w', not {mode!r}")
    if isinstance(path, ObjectPath):
        return _object_open(path, mode)
    return _atomic_open(Path(path), mode, make_parent)


def _name(path: Target) -> str:
    return path.name if isinstance(path, ObjectPath) else os.path.basename(path)


@contextmanager
def naming(path: Target) -> Iterator[None]:
    """An ``OSError`` raised inside the block names ``path`` (pyarrow's write errors, a full
    disk among them, name no file): ``[Errno 28] No space left on device: '<path>'``."""
    try:
        yield
    except OSError as e:
        named = e.filename is not None or _name(path) in str(e)  # pyarrow's S3 errors name it
        if named:
            raise
        code = e.errno if e.errno is not None else errno.EIO
        raise OSError(code, e.strerror or str(e), str(path)) from e


@contextmanager
def _object_open(path: ObjectPath, mode: str) -> Iterator[IO[Any]]:
    buf = io.BytesIO()
    if mode == "w":
        text = io.TextIOWrapper(buf, encoding="utf-8", write_through=True)
        yield text
        text.flush()
    else:
        yield buf
    with naming(path):
        ObjectStore(path.scheme).write_bytes(path, buf.getvalue())


@contextmanager
def _atomic_open(path: Path, mode: str, make_parent: bool = True) -> Iterator[IO[Any]]:
    with naming(path):
        if make_parent:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, 0o666 & ~current_umask())
            f = os.fdopen(fd, mode, encoding="utf-8" if mode == "w" else None)
        except BaseException:
            os.close(fd)
            raise
        with naming(path), f:
            yield f
            fault_point("write")  # a full disk shows here (``write:N:ENOSPC``)
            f.flush()
            os.fsync(f.fileno())
        with naming(path):
            os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with naming(path):
        fsync_dir(path.parent)


def write_bytes_atomic(data: bytes, path: Target) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text_atomic(text: str, path: Target) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_json_atomic(obj: Any, path: Target, *, indent: int | None = 2) -> None:
    """JSON with a trailing newline. Serialised before the temp file is made, so an object
    that cannot be serialised leaves nothing behind."""
    write_text_atomic(json.dumps(obj, indent=indent) + "\n", path)


def write_parquet_atomic(
    table: pa.Table, path: Target, *, make_parent: bool = True, **kwargs: Any
) -> None:
    """``kwargs`` go to ``pyarrow.parquet.write_table`` (compression, row_group_size, ...)."""
    import pyarrow.parquet as pq

    with atomic_open(path, "wb", make_parent=make_parent) as f:
        pq.write_table(table, f, **kwargs)


def save_figure_atomic(fig: Figure, path: Target, **kwargs: Any) -> None:
    """``fig.savefig`` to ``path``; the format comes from the suffix unless given."""
    suffix = path.suffix if isinstance(path, ObjectPath) else Path(path).suffix
    kwargs.setdefault("format", suffix.lstrip(".") or "png")
    with atomic_open(path, "wb") as f:
        fig.savefig(f, **kwargs)
