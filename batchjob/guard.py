"""One resource guard for the code a model folder or a user brings, run per row: chat
templates (Jinja), JSON schemas, regexes and choice lists for structured output.

The limits, the same for each: ``MAX_SECONDS`` of time and ``MAX_CHARS`` characters per row
(a render's output and what it builds; a schema's or a regex's text). An overrun raises
``LimitError`` (a ``ValueError``): the row is rejected with its kind's status
(``chat_template_error``, ``invalid_json_schema``, ``invalid_regex``, ``invalid_choice``) and
the job goes on; a job-level setting (``sampling.json_schema``) is exit 3 naming its key.

Python code (a Jinja template) is bounded in this process: ``deadline()`` arms the clock and
``tick()`` (called at every loop iteration and call) checks it. Native code that cannot be
interrupted (xgrammar compiling a grammar) runs through ``bounded()`` in a guard process,
started once and reused: it is killed and replaced when a call passes ``MAX_SECONDS`` or
``MAX_BYTES`` of memory, so a runaway compile costs one row, never the job.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

MAX_SECONDS = 2.0  # per row: one render, one compile (a real one takes well under 0.1 s)
MAX_CHARS = 16 << 20  # 16,777,216 characters: a render's output and anything it builds
MAX_BYTES = 2 << 30  # memory one native compile may add to the guard process (2 GiB)
START_SECONDS = 600.0  # the guard process's start-up (imports), not counted per row: a
# loaded machine (a CI box, a busy Airflow worker) took over 60 s to import xgrammar


class LimitError(ValueError):
    """A row's render or compile went past a limit of this module."""


# ---------------------------------------------------------------------------------------
# in this process: a deadline checked by the code being run

_deadline = threading.local()  # .at: time.monotonic() deadline of this thread's work


@contextlib.contextmanager
def deadline(seconds: float = MAX_SECONDS) -> Iterator[None]:
    _deadline.at = time.monotonic() + seconds
    try:
        yield
    finally:
        _deadline.at = math.inf


def overrun(what: str) -> LimitError | None:
    """The error when this thread's deadline has passed (None: time is left)."""
    if time.monotonic() > getattr(_deadline, "at", math.inf):
        return LimitError(f"{what} took more than {MAX_SECONDS:g} s (the limit per row)")
    return None


def check_size(n: float, what: str) -> None:
    if n > MAX_CHARS:
        raise LimitError(
            f"{what} would hold {n:.0f} items, more than {MAX_CHARS} (the limit per row)"
        )


# ---------------------------------------------------------------------------------------
# native code: in the guard process

_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "ImportError": ImportError}


class _GuardProcess:
    """``python -m batchjob.guard``: imports ``module`` and the modules its ``GUARD_PRELOAD``
    names (its start-up, once), says it is ready, then answers (module, function, args)
    requests one by one."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchjob.guard", str(MAX_BYTES), module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C is the job's to handle, not the guard's
        )
        self.ready = False

    def _reply(self, seconds: float) -> tuple[str, Any] | None:
        """The next message, None when the process died; TimeoutError after ``seconds``."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        if not ready:
            raise TimeoutError
        return _receive(self.proc.stdout)

    def call(self, what: str, module: str, function: str, args: tuple[Any, ...]) -> Any:
        assert self.proc.stdin is not None
        if not self.ready:  # its imports: not the row's time
            with contextlib.suppress(TimeoutError):
                self.ready = self._reply(START_SECONDS) is not None
            if not self.ready:
                code = self.proc.poll()
                why = (
                    f"it exited with code {code}"
                    if code is not None
                    else f"not ready after {START_SECONDS:g} s of imports"
                )
                raise RuntimeError(f"the guard process (batchjob.guard) did not start: {why}")
        _send(self.proc.stdin, (module, function, args))
        try:
            reply = self._reply(MAX_SECONDS)
        except TimeoutError:
            raise LimitError(
                f"{what} took more than {MAX_SECONDS:g} s (the limit per row)"
            ) from None
        if reply is None:  # the process died: over its memory limit, or killed
            raise LimitError(
                f"{what} needed more than {MAX_BYTES >> 30} GiB of memory (the limit per row)"
            )
        status, value = reply
        if status == "ok":
            return value
        kind, message = value
        raise _ERRORS.get(kind, RuntimeError)(message)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


_guard: _GuardProcess | None = None
_lock = threading.Lock()


def bounded(what: str, module: str, function: str, *args: Any) -> Any:
    """``module.function(*args)`` in the guard process, within ``MAX_SECONDS`` and
    ``MAX_BYTES``: its result, its ValueError or ImportError, or ``LimitError`` naming
    ``what`` on an overrun (the process is then replaced). Arguments and result: picklable."""
    global _guard
    with _lock:
        if _guard is None or _guard.proc.poll() is not None or _guard.module != module:
            if _guard is not None:
                _guard.close()
            _guard = _GuardProcess(module)
        try:
            return _guard.call(what, module, function, args)
        except LimitError:
            _guard.close()
            _guard = _GuardProcess(module)  # the next row's, starting while the job goes on
            raise


def _send(f: Any, obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _receive(f: Any) -> Any:
    head = f.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(f.read(n))


def _serve(max_bytes: int, module: str) -> None:
    import resource

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # only replies go to the parent's pipe
    for name in (module, *getattr(importlib.import_module(module), "GUARD_PRELOAD", ())):
        with contextlib.suppress(ImportError):  # (a missing one: the call's own ImportError)
            importlib.import_module(name)
    _send(stdout, ("ready", None))
    limit_set = False
    while (request := _receive(stdin)) is not None:
        module, function, args = request
        try:
            fn = getattr(importlib.import_module(module), function)
            if not limit_set:  # after the imports: the address space they took, plus the limit
                with contextlib.suppress(OSError, ValueError):
                    with open("/proc/self/statm") as f:
                        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
                    resource.setrlimit(resource.RLIMIT_AS, (used + max_bytes, used + max_bytes))
                limit_set = True
            reply: tuple[str, Any] = ("ok", fn(*args))
        except MemoryError:
            os._exit(1)  # the parent reads no reply: over the memory limit
        except Exception as e:
            kind = next((k for k, t in _ERRORS.items() if isinstance(e, t)), type(e).__name__)
            reply = ("error", (kind, str(e)))
        _send(stdout, reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
