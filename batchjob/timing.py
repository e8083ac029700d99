"""Wall time of a pipeline stage (read, tokenize, plan, ...), for summaries and reports."""

from __future__ import annotations

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
