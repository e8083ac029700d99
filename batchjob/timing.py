"""Wall time of a pipeline stage (read, tokenize, plan, ...), for summaries and reports."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StageTiming:
    """Wall time of one pipeline stage and how much it processed."""

    name: str
    seconds: float
    rows: int
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


_calibration_s = [0.0]  # seconds this process spent measuring kernels against their fallbacks


def add_calibration(seconds: float) -> None:
    """Count ``seconds`` of kernel calibration (a first-use or at-load measurement)."""
    _calibration_s[0] += seconds


def calibration_s() -> float:
    """Seconds of kernel calibration this process has spent so far (load and first use)."""
    return _calibration_s[0]


@dataclass(frozen=True)
class LoopClock:
    """A loop's start, to time it less the kernel calibrations that ran inside it."""

    wall: float
    calibrating: float

    @classmethod
    def start(cls) -> LoopClock:
        return cls(time.perf_counter(), calibration_s())

    def calibration_s(self) -> float:
        """Calibration seconds spent since the start."""
        return calibration_s() - self.calibrating

    def wall_s(self) -> float:
        """Wall seconds since the start, calibrations excluded."""
        return time.perf_counter() - self.wall - self.calibration_s()
