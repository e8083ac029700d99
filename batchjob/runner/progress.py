"""The progress bar of a run on a terminal, and the lines that start and end a run.

tqdm sizes its bar from the terminal; a pseudo-terminal that reports 0 columns and 0 rows
(``script -qc``, ``docker run -t``, many CI runners) reads to tqdm as no room at all, and it
prints nothing. Such a terminal gets 80 x 24 instead; one with a real size keeps tqdm's own.

The start and end lines count the same thing: result rows, one per sample of every row
(``sampling.n``) and one per rejected row, with the input's rows beside them where those
differ (``240 results of 60 rows``).
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from tqdm import tqdm

FALLBACK_COLUMNS, FALLBACK_LINES = 80, 24


def terminal_size(stream: TextIO) -> tuple[int | None, int | None]:
    """(columns, lines) to give tqdm: None where the terminal says its own, the fallback
    where it says 0 (or cannot say)."""
    try:
        size = os.get_terminal_size(stream.fileno())
        cols, lines = size.columns, size.lines
    except (AttributeError, OSError, ValueError):
        cols = lines = 0
    if cols and lines:
        return None, None
    return cols or FALLBACK_COLUMNS, lines or FALLBACK_LINES


def progress_bar(total: int, enabled: bool, stream: TextIO | None = None) -> tqdm:
    """A bar of ``total`` result rows on ``stream`` (stderr), drawn only when ``enabled``."""
    out = stream or sys.stderr
    cols, lines = terminal_size(out) if enabled else (None, None)
    return tqdm(
        total=total,
        unit="row",
        desc="batchjob",
        disable=not enabled,
        file=out,
        ncols=cols,
        nrows=lines,
    )


def results_phrase(results: int, rows: int) -> str:
    """``60 rows``, or ``240 results of 60 rows`` where rows have several samples."""
    return f"{results} rows" if results == rows else f"{results} results of {rows} rows"
