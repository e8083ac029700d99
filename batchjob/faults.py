"""Named kill points for the fault-injection test (off unless BATCHJOB_FAULT_POINT is set).

``BATCHJOB_FAULT_POINT=name:count`` makes the ``count``-th call of ``fault_point("name")``
SIGKILL the process there, as a power cut or the OOM killer would. Unset: one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "BATCHJOB_FAULT_POINT"
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
