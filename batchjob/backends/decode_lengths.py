"""Decode lengths learned while a job runs: how many more tokens a request that is still
decoding will likely produce, for the decode-growth reserve (``kv_projection``) of both
batchllm schedulers (native and vLLM). numpy only: no torch, no vllm.

Rows often stop (EOS, a stop id) long before ``max_tokens``, which users set as a cap.
Projecting every request to its cap reserves KV for tokens that never come and admits too
few requests at once. So every finished request is an observation of its output length,
*censored* when it hit its limit (it might have gone on), and every running request one
censored at its current length, so that the long ones still running count and the estimate
is not biased toward the short ones that finish first. The Kaplan-Meier survival curve of
those gives, for a request that has produced ``out`` tokens, the ``QUANTILE`` of its final
length given that it is past ``out``; its projected remaining tokens are that minus ``out``,
capped by its own limit. Where the curve never falls that far (few ends seen, or every row
running to its limit, as with ``ignore_eos``), the projection is the limit: the
conservative reserve it replaces. An overrun is still caught by preemption."""

from __future__ import annotations

import numpy as np

QUANTILE = 0.5  # of a running request's final length: its median, given how far it has got
MIN_ENDS = 8  # requests that stopped by themselves before any estimate is used


class DecodeLengths:
    """Output lengths of the requests finished so far, as two histograms (stopped by
    themselves / cut at their limit), O(longest output) memory however many rows."""

    def __init__(self, quantile: float = QUANTILE) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        self._log_tail = float(np.log1p(-quantile))  # log P(beyond the quantile)
        self._ended = np.zeros(64, np.int64)  # [n]: stopped by themselves at n outputs
        self._capped = np.zeros(64, np.int64)  # [n]: reached their limit at n outputs
        self.ends = 0

    def finished(self, length: int, capped: bool) -> None:
        """A request finished with ``length`` outputs; ``capped``: at its limit."""
        if length < 1:
            return
        if length >= len(self._ended):
            grow = max(length + 1, 2 * len(self._ended)) - len(self._ended)
            self._ended = np.concatenate([self._ended, np.zeros(grow, np.int64)])
            self._capped = np.concatenate([self._capped, np.zeros(grow, np.int64)])
        (self._capped if capped else self._ended)[length] += 1
        self.ends += 0 if capped else 1

    def table(self, running: np.ndarray) -> RemainingTable:
        """Estimates for one scheduling pass; ``running``: outputs so far of the requests
        still decoding (censored observations)."""
        if self.ends < MIN_ENDS:
            return RemainingTable(None)
        run = np.asarray(running, np.int64)
        top = max(len(self._ended), int(run.max(initial=0)) + 1)
        ended = np.zeros(top, np.int64)
        ended[: len(self._ended)] = self._ended
        censored = np.zeros(top, np.int64)
        censored[: len(self._capped)] = self._capped
        np.add.at(censored, run[run > 0], 1)
        # at risk at length t: observations that reached t (stopped at t or later, or are
        # known to have gone on to t or past it)
        at_risk = np.cumsum((ended + censored)[::-1])[::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            hazard = np.where(at_risk > 0, ended / np.maximum(at_risk, 1), 0.0)
            log_surv = np.cumsum(np.log1p(-hazard))  # log P(length > t), t = 0 .. top - 1
        return RemainingTable(-log_surv, -self._log_tail)


class RemainingTable:
    """``remaining(out, limit)``: projected tokens still to come for a request with ``out``
    outputs and decode limit ``limit`` (at least 1, at most ``limit - out``)."""

    def __init__(self, neg_log_surv: np.ndarray | None, gap: float = 0.0) -> None:
        self._quantile_end: np.ndarray | None = None
        if neg_log_surv is not None:
            # the quantile's end for each out: the first length t > out with
            # S(t) <= (1 - q) S(out); len(neg_log_surv) where the curve never gets there
            # (a tie with S(t) = (1 - q) S(out) counts as reached: 1e-9 below the gap)
            self._quantile_end = np.searchsorted(neg_log_surv, neg_log_surv + gap - 1e-9, "left")
            self._none = len(neg_log_surv)

    def remaining(self, out: int, limit: int) -> int:
        cap = max(limit - out, 1)
        q = self._quantile_end
        if q is None or out >= len(q) or not out < q[out] < self._none:
            return cap  # past the data, or no stop seen that far
        return int(min(q[out] - out, cap))

    def remaining_array(self, out: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """``remaining`` of many requests at once (int64 arrays of outputs and limits)."""
        cap = np.maximum(limit - out, 1)
        q = self._quantile_end
        if q is None:
            return cap
        end = q[np.clip(out, 0, len(q) - 1)]
        known = (out < len(q)) & (out < end) & (end < self._none)
        return np.where(known, np.minimum(end - out, cap), cap)
