"""vLLM's worker started without importing the caller's script again.

vLLM starts its model worker with multiprocessing's ``spawn`` (always on the CPU platform,
and on a GPU once CUDA is initialised). A spawned child first imports the parent's main
module by its file or module name; a script that calls ``batchjob.generate`` at top level,
without an ``if __name__ == "__main__":`` guard, would run again there and fail to start
vLLM ("An attempt has been made to start a new process before the current process has
finished its bootstrapping phase"). The worker runs vLLM's own code only (batchjob passes
class paths, never objects of the script), so while the engine starts the main module is
shown to multiprocessing as one with no file and no name: the child imports nothing of it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_MISSING = object()


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """While the engine (and its spawned worker) starts: ``__main__`` without ``__file__``
    and ``__spec__``, restored after."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: getattr(main, k, _MISSING) for k in ("__file__", "__spec__")}
    try:
        main.__spec__ = None
        if saved["__file__"] is not _MISSING:
            del main.__file__
        yield
    finally:
        for k, v in saved.items():
            if v is not _MISSING:
                setattr(main, k, v)
