"""Named kill points for the fault-injection test (off unless BATCHJOB_FAULT_POINT is set).

``BATCHJOB_FAULT_POINT=name:count`` makes the ``count``-th call of ``fault_point("name")``
SIGKILL the process there, as a power cut or the OOM killer would; ``name:count:ENOSPC`` (any
errno name) raises that ``OSError`` there instead, as a full disk would (``write``, inside every
local atomic write, raises it as pyarrow does: naming no file). Unset: one lookup.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "BATCHJOB_FAULT_POINT"
_hits: dict[str, int] = {}  # calls per spec, so a new spec starts counting afresh


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        if _hits:  # unset again: the next spec, even the same one, counts from zero
            _hits.clear()
        return
    target, _, rest = spec.partition(":")
    if target != name:
        return
    count, _, err = rest.partition(":")
    _hits[spec] = _hits.get(spec, 0) + 1
    if _hits[spec] != int(count or 1):
        return
    if err:
        code = getattr(errno, err)
        if name == "write":
            raise OSError(code, os.strerror(code))
        raise OSError(code, os.strerror(code), f"<fault point {name}>")
    os.kill(os.getpid(), signal.SIGKILL)
