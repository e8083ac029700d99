"""The operator's log: with no terminal (cron, Airflow), one progress line every N seconds.

``batchjob run`` turns it on when stderr is not a terminal; ``BATCHJOB_HEARTBEAT_S`` sets N
(default 30, 0 turns it off). A line reads::

    batchjob: rows 1200/5000 (24.0%), 41.3 rows/s, 2210 tok/s, ETA 1m32s, KV 61% of 2.0 GiB

(KV as a share of ``engine.kv_cache_bytes`` when set, else the bytes in use.)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

ENV = "BATCHJOB_HEARTBEAT_S"
DEFAULT_S = 30.0


def interval_from_env() -> float | None:
    """Seconds between lines, or None when turned off (unset: the default)."""
    raw = os.environ.get(ENV, "").strip()
    try:
        s = float(raw) if raw else DEFAULT_S
    except ValueError:
        s = DEFAULT_S
    return s if s > 0 else None


def _duration(s: float) -> str:
    h, rem = divmod(round(s), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _gib(b: int) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


class Heartbeat:
    """``beat(...)`` after each engine iteration; prints at most one line per ``every_s``."""

    def __init__(
        self,
        total_rows: int,
        every_s: float,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_rows = total_rows
        self.every_s = every_s
        self.stream = stream or sys.stderr
        self.clock = clock
        self.t0 = self.last = clock()

    def say(self, text: str) -> None:
        print(f"batchjob: {text}", file=self.stream, flush=True)

    def line(self, rows_done: int, tokens: int, kv_bytes: int, kv_budget: int) -> str:
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = rows_done / elapsed
        left = self.total_rows - rows_done
        eta = _duration(left / rate) if rate > 0 else "?"
        pct = 100.0 * rows_done / self.total_rows if self.total_rows else 100.0
        kv = f"{_gib(kv_bytes)} in use"
        if kv_budget:
            kv = f"{100.0 * kv_bytes / kv_budget:.0f}% of {_gib(kv_budget)}"
        return (
            f"rows {rows_done}/{self.total_rows} ({pct:.1f}%), {rate:.1f} rows/s, "
            f"{tokens / elapsed:.0f} tok/s, ETA {eta}, KV {kv}"
        )

    def beat(self, rows_done: int, tokens: int, kv_bytes: int, kv_budget: int) -> None:
        now = self.clock()
        if now - self.last >= self.every_s:
            self.last = now
            self.say(self.line(rows_done, tokens, kv_bytes, kv_budget))
